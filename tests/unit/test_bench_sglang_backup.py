"""`refit bench refit`'s SGLang rows: the loader's peak host backup against its bound, on micro-moe."""

from __future__ import annotations

from app.bench import sglang_backup
from app.bench.report import BenchReport


def test_sglang_rows_report_the_backup_peak_against_its_bound() -> None:
    report = BenchReport("refit")
    sglang_backup.rows(report, "micro-moe", 0.25)
    by = {(r.case, r.metric): r for r in report.rows}
    for label in ("BF16", "FP8_BLOCK/MXFP4"):
        case = f"micro-moe {label} sglang transactional bucket 0.25 MiB"
        full = by[(case, "peak host backup (SGLang loader)")]
        assert full.value > 0 and full.value == full.baseline_value  # exactly the bytes the refit overwrites
        previous = by[(case, "peak host backup vs the previous BEGIN copy")]
        assert previous.baseline == sglang_backup.PREVIOUS and previous.baseline_value > previous.value
        failing = by[(case + ", failing at the middle bucket", "peak host backup (SGLang loader)")]
        assert 0 < failing.value < full.value and failing.ratio is not None and failing.ratio >= 1
