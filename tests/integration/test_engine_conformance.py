"""The adapters against the pinned vLLM and SGLang sources: every module, class, function,
field, keyword argument and environment variable they use exists in that version.

The wheels are downloaded once (`pip download --no-deps`) into ~/.cache/rl-refit/wheels (or
$RL_REFIT_WHEEL_CACHE), shared by every checkout on the machine, and
read as zip files by static analysis (nothing is installed or imported). Without a reachable
registry the tests skip, saying so. A mutated copy proves the check fails when a symbol goes.
"""

from __future__ import annotations

import os
import pathlib
import re
from types import ModuleType

import pytest

import adapters.sglang.api as sglang_api
import adapters.vllm.api as vllm_api
from tests.integration.engine_source import Source, adapter_imports, check_uses, fetch_wheel

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE = pathlib.Path(
    os.environ.get("RL_REFIT_WHEEL_CACHE", pathlib.Path.home() / ".cache" / "rl-refit" / "wheels")
)
APIS = {"vllm": vllm_api, "sglang": sglang_api}


# Every supported release of each engine (an adapter's VERSIONS, else its one pin).
RELEASES = [(name, v) for name, api in sorted(APIS.items()) for v in getattr(api, "VERSIONS", (api.VERSION,))]


@pytest.fixture(scope="module", params=RELEASES, ids=[f"{n}-{v}" for n, v in RELEASES])
def engine(request: pytest.FixtureRequest) -> tuple[ModuleType, pathlib.Path]:
    name, version = request.param
    api = APIS[name]
    try:
        wheel = fetch_wheel(api.PACKAGE, version, CACHE)
    except RuntimeError as err:
        pytest.skip(f"cannot download {api.PACKAGE}=={version} (package registry unreachable?): {err}")
    return api, wheel


def test_every_used_symbol_exists_in_the_pinned_version(engine) -> None:  # type: ignore[no-untyped-def]
    api, wheel = engine
    assert check_uses(Source(wheel), api.USES) == []


@pytest.mark.parametrize("name", sorted(APIS))
def test_every_engine_import_of_the_adapter_is_in_its_manifest(name: str) -> None:
    api = APIS[name]
    declared = {target for kind, target, _ in api.USES if kind == "symbol"}
    assert adapter_imports(ROOT / "adapters" / name, name) <= declared


def _mutate(src: Source, module: str, old: str, new: str) -> None:
    rel = module.replace(".", "/") + ".py"
    text = src._read(rel) or src._read(module.replace(".", "/") + "/__init__.py")
    assert text is not None and old in text, f"mutation target {old!r} not in {module}"
    src.overrides[rel if src._read(rel) is not None else module.replace(".", "/") + "/__init__.py"] = \
        text.replace(old, new, 1)


MUTATIONS = {
    "vllm": [
        ("vllm.model_executor.model_loader.reload.layerwise", "def initialize_layerwise_reload(",
         "def initialize_layerwise_reload_v2(", "initialize_layerwise_reload: not defined"),
        ("vllm.engine.arg_utils", "    linear_backend: LinearBackend", "    linear_kernel: LinearBackend",
         "EngineArgs: no keyword ['linear_backend']"),
        ("vllm.envs", '"VLLM_USE_DEEP_GEMM_E8M0": lambda', '"VLLM_DEEP_GEMM_E8M0": lambda',
         "VLLM_USE_DEEP_GEMM_E8M0: environment variable not read"),
        ("vllm.model_executor.layers.attention.attention", "def set_default_quant_scales(layer: nn.Module, "
         "register_buffer: bool = False)", "def set_default_quant_scales(layer: nn.Module)",
         "set_default_quant_scales: no keyword ['register_buffer']"),
    ],
    "sglang": [
        ("sglang.srt.entrypoints.engine", "        flush_cache: bool = True,\n    ):\n        \"\"\"Update weights from "
         "distributed source. If there", "        flush: bool = True,\n    ):\n        \"\"\"Update weights from "
         "distributed source. If there", "Engine.update_weights_from_tensor: no keyword ['flush_cache']"),
        ("sglang.srt.model_loader.loader", "quant_method.process_weights_after_loading(module)\n\n"
         "    @staticmethod\n    def restore_weights_before_loading",
         "pass\n\n    @staticmethod\n    def restore_weights_before_loading",
         "postprocess_weights: source no longer contains ['quant_method.process_weights_after_loading(module)']"),
        ("sglang.srt.arg_groups.fields.model", "    custom_weight_loader: A[", "    weight_loader_plugins: A[",
         "custom_weight_loader: no such field"),
        ("sglang.srt.entrypoints.http_server", '@app.post("/pause_generation")', '@app.post("/pause")',
         "pause_generation: missing values ['/pause_generation']"),
        ("sglang.srt.utils.common", "ForkingPickler(buf).dump(obj)", "pickle.Pickler(buf).dump(obj)",
         "MultiprocessingSerializer.serialize: source no longer contains ['ForkingPickler(buf).dump(obj)']"),
    ],
}


def test_a_mutated_copy_fails_when_used_symbols_disappear(engine) -> None:  # type: ignore[no-untyped-def]
    api, wheel = engine
    src = Source(wheel)
    for module, old, new, _ in MUTATIONS[api.PACKAGE]:
        _mutate(src, module, old, new)
    problems = check_uses(src, api.USES)
    for *_, expected in MUTATIONS[api.PACKAGE]:
        assert any(expected in p for p in problems), f"{expected!r} not reported; got {problems}"
    assert len(problems) >= len(MUTATIONS[api.PACKAGE])


def test_the_pins_match_the_packaging_extras() -> None:
    from adapters.vllm.profile import VLLM_RANGE

    text = (ROOT / "pyproject.toml").read_text()
    assert f'vllm = ["vllm{VLLM_RANGE}"]' in text
    lowest, upper = VLLM_RANGE.split(",")
    assert lowest == f">={vllm_api.VERSIONS[0].rsplit('.', 1)[0]}" and vllm_api.VERSION.startswith(vllm_api.VERSIONS[-1])
    assert upper.startswith("<") and vllm_api.VERSIONS[-1] < upper[1:]
    api = sglang_api
    assert re.search(rf'"{api.PACKAGE}=={re.escape(api.VERSION)}"', text), f"pyproject pins {api.PACKAGE}?"
