"""The transport choice: `auto` by where the tensors and receivers live; explicit choices checked."""

from __future__ import annotations

import attrs
import pytest

from adapters.vllm.config import VllmEngineConfig
from domain.errors import ConfigError
from domain.refit.transport_choice import CHOICES, choose_transport

TRANSPORT_KEY = "rollout.engine_kwargs.vllm.transport"


@pytest.mark.parametrize(("source", "receiver", "same_host", "expected"), [
    ("cuda", "cuda", True, "cuda_ipc"),
    ("cuda", "cuda", False, "nccl"),
    ("cpu", "cpu", True, "shm"),
    ("cuda", "cpu", True, "shm"),
    ("cpu", "cuda", True, "shm"),
    ("cpu", "cpu", False, "gloo"),
    ("cuda", "cpu", False, "gloo"),
])
def test_auto_picks_by_where_the_ends_live(source, receiver, same_host, expected):
    choice = choose_transport("auto", source_device=source, receiver_device=receiver, same_host=same_host)
    assert choice.name == expected and choice.reason.startswith("auto:")


@pytest.mark.parametrize(("requested", "source", "receiver", "same_host", "suggested"), [
    ("nccl", "cpu", "cpu", False, "gloo"),
    ("cuda_ipc", "cuda", "cpu", True, "shm"),
    ("cuda_ipc", "cuda", "cuda", False, "nccl"),
    ("shm", "cpu", "cpu", False, "gloo"),
])
def test_a_transport_that_cannot_reach_the_ends_names_the_key_and_the_one_that_can(requested, source, receiver,
                                                                                    same_host, suggested):
    with pytest.raises(ConfigError) as info:
        choose_transport(requested, source_device=source, receiver_device=receiver, same_host=same_host,
                         config_key=TRANSPORT_KEY)
    assert info.value.key == TRANSPORT_KEY and f"use {suggested}" in str(info.value)


@pytest.mark.parametrize("requested", ["shm", "gloo", "nccl", "cuda_ipc"])
def test_an_explicit_choice_that_applies_is_kept(requested):
    choice = choose_transport(requested, source_device="cuda", receiver_device="cuda", same_host=True)
    assert choice.name == requested


def test_unknown_names_are_refused_and_the_config_key_accepts_every_choice():
    with pytest.raises(ConfigError, match="unknown transport 'tcp'"):
        choose_transport("tcp", source_device="cpu", receiver_device="cpu", same_host=True)
    transport = next(f for f in attrs.fields(VllmEngineConfig) if f.name == "transport")
    assert set(transport.metadata["setting"].choices) == set(CHOICES)
