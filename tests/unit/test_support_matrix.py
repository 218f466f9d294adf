"""EngineSupportMatrix, the engines' support matrix (domain.quant.support): one verdict per cell, each rejected
cell refused by `refit plan` with the engine's reason, each shown cell passing unchanged, and
docs/support-matrix.md written from the same table."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from adapters.engine_profile import SGLANG_MXFP8
from adapters.sglang.profile import PINNED_SGLANG
from adapters.vllm.profile import PINNED_VLLM
from domain.errors import EngineCellUnsupported, EngineRejectsQuantization, UnsupportedCombination
from domain.quant import support
from domain.quant.formats import FORMATS, ActivationScheme
from domain.quant.plan import ACTIVATIONS, QuantizationPlan
from domain.quant.support import COMPRESSED_TENSORS, MODELOPT_NVFP4, NATIVE_FP8, Cell, Verdict
from tests import dispatching
from tests.dispatching import DispatchInput, check_cells, resolve

DOCS = Path(__file__).resolve().parents[2] / "docs"
VERDICTS = dispatching.verdicts()
REJECTED = [v for v in VERDICTS.values() if not v.shown]
SHOWN = [v for v in VERDICTS.values() if v.shown]
NATIVE_CONFIGS = {
    NATIVE_FP8: {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    SGLANG_MXFP8: {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32]},
}


def _id(v: Verdict) -> str:
    c = v.cell
    return f"{c.engine}-{c.layout}-{c.role}-{c.fmt}-{c.activation.value}"


def _only(cell: Cell) -> QuantizationPlan:
    """The plan that asks for this cell and nothing else (the other role BF16)."""
    kw = {cell.role: cell.fmt, f"{cell.role}_activation": cell.activation.value}
    return QuantizationPlan.from_presets(**kw)  # type: ignore[arg-type]


# --- the table covers every cell, once, with its evidence -----------------------------------------


def test_every_cell_has_exactly_one_verdict() -> None:
    cells = dispatching.all_cells()
    assert len(cells) == len(set(cells)) == len(VERDICTS)
    assert set(cells) == set(VERDICTS)
    # every preset, role and exportable activation scheme of both engines is a compressed-tensors cell
    for engine in dispatching.SUPPORT_ENGINES:
        for fmt, acts in ACTIVATIONS.items():
            for act in acts:
                for role in support.ROLES:
                    cell = Cell(engine, COMPRESSED_TENSORS, role, fmt, act)
                    assert (cell in VERDICTS) is (act is not ActivationScheme.NVFP4_STATIC), cell


@pytest.mark.parametrize("v", list(VERDICTS.values()), ids=_id)
def test_every_verdict_cites_the_pinned_wheel(v: Verdict) -> None:
    prefix = {"vllm": f"vllm {PINNED_VLLM} vllm/", "sglang": f"sglang {PINNED_SGLANG} sglang/srt/"}[v.cell.engine]
    for where in v.where:
        assert where.startswith(prefix), where
        assert re.fullmatch(r"\S+\.py:\d+(-\d+)?", where.split(" ", 2)[2]), where
    assert v.engine_path
    if not v.shown:
        assert v.reason and v.instead


def test_a_verdict_without_its_evidence_is_refused() -> None:
    cell = Cell("vllm", COMPRESSED_TENSORS, "linear", "NVFP4", ActivationScheme.NONE)
    with pytest.raises(ValueError, match="code locations"):
        Verdict(cell, True, "x", ())
    with pytest.raises(ValueError, match="reason"):
        Verdict(cell, False, "x", ("vllm 0.33.0 vllm/a.py:1",))


def test_the_suspected_cells_are_rejected() -> None:
    # The three suspicions of issue 15, as verdicts: vLLM's compressed-tensors NVFP4 W4A4 needs a
    # static input_global_scale; SGLang serves no compressed-tensors dense MXFP4/MXFP8.
    for role in support.ROLES:
        v = VERDICTS[Cell("vllm", COMPRESSED_TENSORS, role, "NVFP4", ActivationScheme.NVFP4_PER_TOKEN)]
        assert not v.shown and "input_global_scale" in v.reason
    for fmt, act in (("MXFP4", ActivationScheme.MXFP4), ("MXFP8", ActivationScheme.MXFP8)):
        v = VERDICTS[Cell("sglang", COMPRESSED_TENSORS, "linear", fmt, act)]
        assert not v.shown and "NotImplementedError" in v.reason


# --- refit plan rejects every cell that is not shown --------------------------------------------------


def _dispatch(cell: Cell) -> DispatchInput:
    if (cell.engine, cell.layout, cell.fmt) == ("sglang", COMPRESSED_TENSORS, "MXFP8"):
        # SGLang serves a plan whose only preset is MXFP8 natively: compressed-tensors MXFP8 needs another
        # preset beside it (FP8_BLOCK, shown in both roles)
        other = "moe" if cell.role == "linear" else "linear"
        return DispatchInput(engine="sglang", requested=attrs.evolve(_only(cell), **{other: FORMATS["FP8_BLOCK"]}))
    if (cell.engine, cell.layout, cell.role, cell.fmt) == ("vllm", COMPRESSED_TENSORS, "moe", "NVFP4") and (
            cell.activation is ActivationScheme.NVFP4_PER_TOKEN):
        # vLLM serves per-token NVFP4 experts alone in ModelOpt's layout: compressed-tensors ones need a
        # quantized Linear beside them (FP8_BLOCK, shown)
        return DispatchInput(engine="vllm", requested=attrs.evolve(_only(cell), linear=FORMATS["FP8_BLOCK"]))
    if cell.layout in (COMPRESSED_TENSORS, MODELOPT_NVFP4) or (cell.engine, cell.layout) == ("sglang", SGLANG_MXFP8):
        return DispatchInput(engine=cell.engine, requested=_only(cell))
    return DispatchInput(engine=cell.engine, model_config={"quantization_config": NATIVE_CONFIGS[cell.layout]})


@pytest.mark.parametrize("v", REJECTED, ids=_id)
def test_refit_plan_rejects_the_cell_with_the_engines_reason(v: Verdict) -> None:
    c = v.cell
    with pytest.raises(EngineCellUnsupported) as info:
        check_cells(c.engine, _only(c), c.layout)
    err = info.value
    assert (err.engine, err.layout, err.role, err.fmt, err.activation) == (
        c.engine, c.layout, c.role, c.fmt, c.activation.value)
    assert (err.reason, err.where, err.instead) == (v.reason, v.where[0], v.instead)
    text = str(err)
    for part in (f"rollout.name={c.engine}", f"rollout.quantization.{c.role}={c.fmt}", c.activation.value,
                 v.reason, v.where[0], v.instead):
        assert part in text
    assert isinstance(err, EngineRejectsQuantization) and isinstance(err, ValueError)
    if c.layout == MODELOPT_NVFP4:  # no plan with quantized Linear layers takes ModelOpt's layout
        with pytest.raises(EngineCellUnsupported) as as_ct:
            resolve(_dispatch(c))
        assert as_ct.value.layout == COMPRESSED_TENSORS
        return
    # the same through the dispatch, from the configuration or the checkpoint the cell comes from
    with pytest.raises(EngineCellUnsupported) as via_plan:
        resolve(_dispatch(c))
    assert via_plan.value.engine == c.engine and via_plan.value.layout == c.layout


@pytest.mark.parametrize("v", [v for v in SHOWN if v.cell.layout == COMPRESSED_TENSORS], ids=_id)
def test_a_shown_cell_passes_and_its_plan_row_is_unchanged(v: Verdict) -> None:
    c = v.cell
    res = resolve(_dispatch(c))
    unchecked = resolve(attrs.evolve(_dispatch(c), engine="reference"))  # no support table: the plan as before
    assert (res.plan, res.layout, res.source) == (unchecked.plan, unchecked.layout, unchecked.source)
    assert res.layout == COMPRESSED_TENSORS and res.plan == _only(c)
    shown = next(o.outcome for o in res.outcomes if o.rule == "EngineSupportMatrix")
    assert shown.startswith("ok:") and f"{c.role} {c.fmt}/{c.activation.value}" in shown


@pytest.mark.parametrize("v", [v for v in SHOWN if v.cell.layout not in (COMPRESSED_TENSORS, MODELOPT_NVFP4)], ids=_id)
def test_a_shown_native_cell_passes_in_its_layout(v: Verdict) -> None:
    res = resolve(_dispatch(v.cell))
    assert res.layout == v.cell.layout and res.plan.scale_name == "weight_scale_inv"


def test_per_token_nvfp4_experts_alone_are_served_by_vllm_in_modelopts_layout() -> None:
    plan = QuantizationPlan.from_presets(moe="NVFP4")  # nvfp4_per_token, the preset's default
    res = resolve(DispatchInput(engine="vllm", requested=plan))
    assert res.layout == MODELOPT_NVFP4 and res.plan.expert_layout == "modelopt"
    assert res.plan.scale_name == "weight_scale"  # not an engine-native layout
    v = VERDICTS[Cell("vllm", MODELOPT_NVFP4, "moe", "NVFP4", ActivationScheme.NVFP4_PER_TOKEN)]
    assert v.shown and "TRT-LLM" in v.note and "SM100" in v.note
    # with a quantized Linear beside them, the experts stay compressed-tensors, which vLLM refuses
    with pytest.raises(EngineCellUnsupported, match="input_global_scale"):
        resolve(DispatchInput(engine="vllm", requested=attrs.evolve(plan, linear=FORMATS["FP8_BLOCK"])))
    # SGLang has no per-token NVFP4 experts in any layout
    with pytest.raises(EngineRejectsQuantization):
        resolve(DispatchInput(engine="sglang", requested=plan))


def test_static_nvfp4_stays_rejected_for_every_engine_before_the_table() -> None:
    for engine in ("vllm", "sglang", "reference"):
        plan = QuantizationPlan.from_presets(moe="NVFP4", moe_activation="nvfp4_static")
        with pytest.raises(UnsupportedCombination, match="input_global_scale") as info:
            resolve(DispatchInput(engine=engine, requested=plan))
        assert not isinstance(info.value, EngineCellUnsupported)


def test_engines_without_a_table_and_bf16_plans_pass() -> None:
    nvfp4 = QuantizationPlan.from_presets(linear="NVFP4")
    assert check_cells("reference", nvfp4) == [] and check_cells("trtllm", nvfp4) == []
    assert check_cells("vllm", QuantizationPlan.bf16()) == []
    assert check_cells("vllm", nvfp4, "native-passthrough") == []  # nothing the trainer exports
    assert resolve(DispatchInput(engine="reference", requested=nvfp4)).plan.is_quantized


def test_both_roles_are_checked_linear_first() -> None:
    plan = QuantizationPlan.from_presets(linear="MXFP4", moe="NVFP4")  # vLLM: MXFP4 Linear shown, NVFP4 experts not
    with pytest.raises(EngineCellUnsupported) as info:
        check_cells("vllm", plan)
    assert (info.value.role, info.value.fmt) == ("moe", "NVFP4")
    both = QuantizationPlan.from_presets(linear="NVFP4", moe="NVFP4")
    with pytest.raises(EngineCellUnsupported) as info:
        check_cells("sglang", both)
    assert info.value.role == "linear"


def test_the_cli_refuses_a_rejected_cell_on_one_line(capsys: pytest.CaptureFixture) -> None:
    from app.cli.main import main

    assert main(["plan", "rollout.name=vllm", "rollout.quantization.linear=NVFP4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "EngineCellUnsupported" in err[0] and "input_global_scale" in err[0]
    assert main(["plan", "rollout.name=vllm", "rollout.quantization.linear=NVFP4",
                 "rollout.quantization.linear_activation=none"]) == 0


# --- docs/support-matrix.md is this table -----------------------------------------------------------------


def test_docs_support_matrix_lists_every_verdict_as_the_code_has_it() -> None:
    from app.services.planning import support_matrix_rows

    text = (DOCS / "support-matrix.md").read_text()
    for engine in dispatching.SUPPORT_ENGINES:
        section = text.split(f"\n### Cells: {engine}\n", 1)[1].split("\n#", 1)[0]
        documented = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| role")]
        expected = support_matrix_rows(engine)
        assert documented == expected, f"docs/support-matrix.md: the {engine} cells are out of date; run " \
            "scripts/render_support_matrix.py"
