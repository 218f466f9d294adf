"""`refit bench refit`'s loader backup rows (SGLang's, the one engine plugin with an in-process
backup): the loader's peak host backup against its bound, on micro-moe."""

from __future__ import annotations

from app.bench import loader_backup
from app.bench.report import BenchReport


def test_every_engine_with_a_loader_backup_has_its_rows_against_their_bounds() -> None:
    assert set(loader_backup.backups()) == {"sglang"}
    report = BenchReport("refit")
    loader_backup.rows(report, "micro-moe", 0.25)
    by = {(r.case, r.metric): r for r in report.rows}
    for label in ("BF16", "FP8_BLOCK/MXFP4"):
        case = f"micro-moe {label} sglang transactional bucket 0.25 MiB"
        full = by[(case, "peak host backup (SGLang loader)")]
        assert full.value > 0 and full.value == full.baseline_value  # exactly the bytes the refit overwrites
        previous = by[(case, "peak host backup vs the previous BEGIN copy")]
        assert previous.baseline == loader_backup.PREVIOUS and previous.baseline_value > previous.value
        failing = by[(case + ", failing at the middle bucket", "peak host backup (SGLang loader)")]
        assert 0 < failing.value < full.value and failing.ratio is not None and failing.ratio >= 1
    assert any(n.startswith("sglang rows: SGLang's custom loader") and "32768 positions" in n for n in report.notes)
