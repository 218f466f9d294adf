"""The error hierarchy: one base, each class's bases as documented, every error importable from
domain.errors (the package's modules are its inside) or from the adapter that keeps it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import adapters.vllm.errors
import domain.errors as errors

# Every error class and its direct bases: the hierarchy callers rely on (`except ValueError`, ...).
BASES = {
    "AdapterUpdateFailed": "RefitError, RuntimeError",
    "BlockMisaligned": "InvalidTensor",
    "BoundaryLayersMismatch": "UnsupportedCombination",
    "BucketLayoutError": "RefitError, ValueError",
    "BucketSequenceError": "RefitLifecycleError",
    "CheckpointError": "RefitError, ValueError",
    "CollectiveTimeout": "RefitError, TimeoutError",
    "ConfigError": "RefitError, ValueError",
    "ConfigNotHonoured": "UnsupportedCombination",
    "ConfigTypeError": "ConfigError, TypeError",
    "DeltaBaseMismatch": "RefitError, ValueError",
    "DeltaRecordError": "RefitError, ValueError",
    "DistributedRefitFailed": "RefitFailed",
    "EngineBusy": "RefitLifecycleError",
    "EngineClosed": "RefitLifecycleError",
    "RefitInProgress": "RefitLifecycleError",
    "EngineCellUnsupported": "EngineRejectsQuantization",
    "EngineProcessError": "RefitError, RuntimeError",
    "EngineRefitUnsupported": "RefitError, NotImplementedError",
    "EngineRejectsQuantization": "UnsupportedCombination",
    "EngineStale": "RefitError, RuntimeError",
    "EngineTensorMismatch": "RefitError, ValueError",
    "EngineUpdateFailed": "RefitError, RuntimeError",
    "ForeignLockFile": "RefitError, FileExistsError",
    "FusedForwardModeError": "ConfigError",
    "FusedForwardUnsupported": "RefitError, NotImplementedError",
    "FusedGroupSplit": "UnsupportedCombination",
    "FusedHookUnavailable": "RefitError, RuntimeError",
    "GpuCapabilityTooLow": "UnsupportedCombination",
    "InjectedFault": "RefitError, RuntimeError",
    "InvalidPackedBoundaries": "RefitError, ValueError",
    "InvalidTemperature": "RefitError, ValueError",
    "InvalidTensor": "RefitError, ValueError",
    "MegatronModelUnsupported": "RefitError, NotImplementedError",
    "LoraError": "RefitError, ValueError",
    "LoraShapeMismatch": "LoraError",
    "LoraRankMismatch": "LoraError",
    "LoraNonFinite": "LoraError",
    "LoraUnknownTarget": "LoraError",
    "LoraUnsupported": "LoraError, NotImplementedError",
    "MismatchInputError": "RefitError, ValueError",
    "NativeLayoutMismatch": "CheckpointError",
    "NativeLayoutOverride": "UnsupportedCombination",
    "NativeRefitUnsupported": "UnsupportedQuantMethod",
    "NonDivisibleTensors": "RefitError, ValueError",
    "NonFiniteTensor": "InvalidTensor",
    "OutputBusy": "RefitError, BlockingIOError",
    "OutputChanged": "RefitError, FileExistsError",
    "OutputNotEmpty": "RefitError, FileExistsError",
    "OutputNotWritable": "RefitError, OSError",
    "OutputOverlapsModel": "CheckpointError",
    "OutputProtected": "OutputNotEmpty",
    "PackedGdnDeterministic": "UnsupportedCombination",
    "PackedGdnUnsupported": "RefitError, NotImplementedError",
    "PeerFailed": "RefitError, RuntimeError",
    "PeerLost": "RefitError, ConnectionError",
    "ProbeMismatch": "RefitVerificationFailed",
    "QatLayoutError": "RefitError, ValueError",
    "QatModeMismatch": "UnsupportedCombination",
    "QatNumericsMismatch": "RefitError, RuntimeError",
    "QatPrecisionMismatch": "RefitError, ValueError",
    "QatStateError": "RefitError, RuntimeError",
    "QatUnsupportedModel": "RefitError, NotImplementedError",
    "QatWithTeRecipe": "UnsupportedCombination",
    "QuantizedDeltaSync": "UnsupportedCombination",
    "QuantizedSource": "CheckpointError",
    "RankFailed": "RefitError, RuntimeError",
    "RefitError": "Exception",
    "RefitFailed": "RefitError, RuntimeError",
    "RefitIncomplete": "RefitError, RuntimeError",
    "RefitLifecycleError": "RefitError, RuntimeError",
    "RefitVerificationFailed": "RefitError, RuntimeError",
    "RemovedConfigKey": "ConfigError",
    "ShardingError": "RefitError, ValueError",
    "ServerMismatch": "RefitError, ValueError",
    "ServerUnreachable": "RefitError, ConnectionError",
    "SessionRefused": "RefitError, PermissionError",
    "SharedMemoryUnavailable": "RefitError, OSError",
    "SourceChanged": "CheckpointError",
    "StorageRebound": "RefitError, RuntimeError",
    "ThdPackingError": "RefitError, ValueError",
    "TransportAborted": "RefitError, RuntimeError",
    "UnknownConfigKey": "ConfigError, KeyError",
    "UnsupportedCombination": "RefitError, ValueError",
    "UnsupportedDtype": "InvalidTensor, TypeError",
    "UnsupportedQuantMethod": "RefitError, NotImplementedError",
    "UnsupportedShape": "InvalidTensor",
    "WireProtocolError": "RefitError, RuntimeError",
    "WorkerError": "EngineUpdateFailed",
}
# The errors only one engine adapter raises, kept in that adapter.
IN_ADAPTERS = {"EngineProcessError": adapters.vllm.errors, "EngineRefitUnsupported": adapters.vllm.errors,
               "WorkerError": adapters.vllm.errors, "SessionRefused": adapters.vllm.errors}


def _package_classes() -> dict[str, type]:
    """Every RefitError subclass defined in a module of the domain.errors package."""
    out: dict[str, type] = {}
    for info in pkgutil.iter_modules(errors.__path__):
        module = importlib.import_module(f"{errors.__name__}.{info.name}")
        out.update({name: cls for name, cls in inspect.getmembers(module, inspect.isclass)
                    if issubclass(cls, errors.RefitError) and cls.__module__ == module.__name__})
    return out


def test_the_package_exports_every_error_it_defines() -> None:
    defined = _package_classes()
    assert len(defined) > 60  # the walk itself works
    assert sorted(errors.__all__) == sorted(defined)
    for name, cls in defined.items():
        assert getattr(errors, name) is cls, name


def test_every_error_keeps_its_bases() -> None:
    found = {**_package_classes(), **{name: getattr(module, name) for name, module in IN_ADAPTERS.items()}}
    assert sorted(found) == sorted(BASES)
    for name, cls in found.items():
        assert ", ".join(b.__name__ for b in cls.__bases__) == BASES[name], name
        assert issubclass(cls, errors.RefitError)


def test_adapter_errors_are_not_in_the_domain() -> None:
    for name, module in IN_ADAPTERS.items():
        assert not hasattr(errors, name), name
        assert getattr(module, name).__module__ == module.__name__
