"""The worker protocol's records through vLLM's own msgpack (vllm.v1.serial_utils, what
`LLM.collective_rpc` arguments and results cross with the multiprocess engine): every record
comes back equal, every error that may cross comes back as itself."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

from adapters.vllm import protocol as p
from tests.unit.test_vllm_protocol import SAMPLES, _instance


def _vllm_msgpack(value: Any) -> Any:
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackDecoder().decode(MsgpackEncoder().encode(value))


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_crosses_vllms_msgpack_unchanged(record: p.Record) -> None:
    assert type(record).from_plain(_vllm_msgpack(record.to_plain())) == record


@pytest.mark.parametrize("cls", list(p.ERRORS.values()), ids=lambda c: c.__name__)
def test_every_error_crosses_vllms_msgpack_as_itself(cls: type[BaseException]) -> None:
    original = _instance(cls)
    rebuilt = p.ErrorReply.from_plain(_vllm_msgpack(p.ErrorReply.of(original).to_plain())).rebuild()
    assert type(rebuilt) is cls and str(rebuilt) == str(original) and vars(rebuilt) == vars(original)
