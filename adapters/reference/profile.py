"""The embedded reference engine's profile: it serves every plan the trainer exports, so it has
no support table, no backend policy and no rules of its own."""

from __future__ import annotations

from adapters.engine_profile import NATIVE_LAYOUTS, StaticEngineProfile
from domain.quant.dispatch_types import EngineDispatch

NAME = "reference"

REFERENCE = StaticEngineProfile(NAME, EngineDispatch(NAME, NATIVE_LAYOUTS))
