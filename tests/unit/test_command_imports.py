"""A command loads only what it uses: `refit --help` lists every command without importing one,
`refit plan` loads neither a demo, a benchmark nor an engine, and `refit <command> --help` still
shows the command's own flags. Measured in a fresh interpreter (app.bench.imports, the same
measure `refit bench imports` reports)."""

from __future__ import annotations

import pytest

from app.bench.imports import command
from app.cli.main import COMMANDS, main

# `refit --help` loads app, app.cli, app.cli.main, and domain with domain.errors (the entry
# point's typed errors: the package and its 10 modules): 15 of the project's modules when this
# was written. The bound leaves room for a few more error modules, and none for a command module
# or torch (every command module imports at least the configuration or the domain's values).
HELP_MAX_PROJECT_MODULES = 18

# What `refit plan` never needs: the other commands, the demos, the benchmarks, the refit itself,
# and every adapter but the engines' profiles and the checkpoint readers and writers of a plan.
PLAN_NEVER = (
    "app.bench", "app.cli.demo", "app.cli.bench", "app.cli.export", "app.cli.doctor", "app.cli.mismatch",
    "app.services.demo", "app.services.lora_demo", "app.services.engine_demo", "app.services.qat_demo",
    "app.services.megatron_demo", "app.services.distributed_demo", "app.services.refit",
    "app.services.distributed_refit", "app.services.transaction", "app.services.doctor",
    "adapters.megatron", "adapters.distributed", "adapters.hf.", "adapters.memory", "adapters.modelopt",
    "adapters.qat_reference",
)
# The engine packages: a plan reads each engine's profile (every engine's dispatch rules are part
# of every plan, reporting "n/a" for the engines they are not about), nothing else of them.
ENGINE_PACKAGES = ("adapters.vllm", "adapters.sglang", "adapters.reference", "adapters.trtllm")
# What a BF16 plan never imports: compressed-tensors (and through it transformers and torchao) builds
# only the compressed-tensors layout's quantization_config, and takes seconds to import.
BF16_NEVER = ("compressed_tensors", "transformers", "torchao", "adapters.compressed_tensors")


def test_refit_help_lists_every_command_and_imports_none() -> None:
    loaded = command(["--help"])
    assert loaded.code == 0
    assert len(loaded.project) <= HELP_MAX_PROJECT_MODULES, loaded.project
    assert not [m for m in loaded.project if m.startswith("app.cli.") and m != "app.cli.main"]
    assert "torch" not in loaded.modules


def test_refit_plan_loads_no_demo_benchmark_refit_or_engine() -> None:
    loaded = command(["plan"])
    assert loaded.code == 0
    assert "app.cli.plan" in loaded.project  # the measure sees the command's modules
    never = sorted(m for m in loaded.project if m.startswith(PLAN_NEVER))
    engines = sorted(m for m in loaded.project if m.startswith(ENGINE_PACKAGES)
                     and m not in ENGINE_PACKAGES and not m.endswith((".profile", ".config", ".engine_plugin")))
    assert not never and not engines, f"refit plan loads {never + engines}"


def test_a_bf16_plan_imports_no_compressed_tensors() -> None:
    loaded = command(["plan"])  # the default configuration: the embedded engine, BF16
    assert loaded.code == 0
    assert not sorted(m for m in loaded.modules if m.startswith(BF16_NEVER))


def test_a_compressed_tensors_plan_imports_it() -> None:  # the measure above sees the package when it loads
    loaded = command(["plan", "rollout.name=vllm", "rollout.quantization.linear=FP8_BLOCK"])
    assert loaded.code == 0
    assert "compressed_tensors" in loaded.modules and "adapters.compressed_tensors.quantization_config" in loaded.modules


# What the embedded `refit demo` never needs: the other modes (LoRA, Megatron, processes, QAT),
# the other commands, and every engine's adapter but the embedded one's (the plugin table reads
# each engine's profile, section and plugin record, nothing else of them).
DEMO_NEVER = (
    "domain.lora.", "app.services.lora_demo", "app.services.megatron_demo", "app.services.distributed_demo",
    "app.services.qat_demo", "app.services.engine_demo", "app.bench", "app.cli.export", "app.cli.doctor",
    "app.cli.plan", "adapters.megatron", "adapters.distributed", "adapters.hf.", "adapters.modelopt",
)


def test_the_embedded_demo_loads_no_other_mode_command_or_engine() -> None:
    loaded = command(["demo", "--steps", "1"])
    assert loaded.code == 0
    assert "app.cli.demo" in loaded.project and "adapters.reference.engine" in loaded.project
    never = sorted(m for m in loaded.project if m.startswith(DEMO_NEVER) or m == "domain.lora")
    engines = sorted(m for m in loaded.project if m.startswith(ENGINE_PACKAGES[:2] + ENGINE_PACKAGES[3:])
                     and m not in ENGINE_PACKAGES and not m.endswith((".profile", ".config", ".engine_plugin")))
    assert not never and not engines, f"refit demo loads {never + engines}"
    assert not sorted(m for m in loaded.modules if m.startswith(BF16_NEVER))  # its plan is BF16


def test_the_top_level_help_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, spec in COMMANDS.items():
        assert name in out and spec.help.split()[0] in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_commands_help_shows_its_own_flags(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: refit {name}")
    assert "--json" in out or (name == "bench" and "--quick" in out)  # one of the command's own options
    assert "--debug" in out
