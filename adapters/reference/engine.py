"""The embedded rollout engine: a pure-torch causal LM serving weights in the rollout format.

It stages a refit's buckets into shadow tensors, post-processes each fused module once, verifies
the staged weights, and copies them into its live tensors in place: their data pointers, shapes,
strides and dtypes never change (what CUDA-graph capture needs). A bucket marked `retained` (its
buffer stays valid until the refit ends) is staged by reference: the engine keeps views of it and
copies each tensor once, from the bucket into the live tensor, at commit. Two commit modes:

- transactional (default): nothing live is touched until every bucket is in and verified; any
  failure leaves the live weights bit-identical. Extra memory: the staged quantized tensors.
- per-layer: a layer is post-processed, verified and committed as soon as all its tensors are in;
  extra memory is one layer. A failure after a commit marks the engine stale: it refuses to serve
  until a full refit succeeds.

After a quantized refit, attention layers whose KV-cache scales were left at the loader's
placeholder are reset to 1.0 unless the quantization config has a `kv_cache_scheme`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs
import structlog
import torch

from adapters.reference.config import ReferenceModelConfig, hf_weight_shapes
from adapters.reference.layout import GLOBAL, EngineLayout, is_routed
from adapters.reference.model import check_input_ids, forward_logits, log_probs_from_logits, slot_table
from domain.errors import AdapterUpdateFailed, EngineTensorMismatch, LoraError, RefitVerificationFailed
from domain.quant.codecs import QuantizedWeight, dequantize_weight, fake_quantize_activation
from domain.quant.plan import QuantizationPlan
from domain.refit.buckets import Bucket, unpack_bucket
from domain.refit.delta_sync import DeltaBase, DeltaReceiver
from domain.refit.guard import EngineGuard
from domain.refit.report import EngineFinalizeResult
from domain.refit.session import CommitMode
from domain.refit.storage import StorageFingerprint, tensor_digest

if TYPE_CHECKING:  # the adapter mode's types: domain.lora loads only when an adapter is staged
    from domain.lora import LoraAdapter
    from domain.lora.sync import StagedAdapter

# A verifier sees one commit group's post-processed tensors ("key.local" -> tensor) before they
# are committed, and raises to stop the commit.
Verifier = Callable[[str, Mapping[str, torch.Tensor]], None]
# A staged tensor: a whole staging tensor, or views staged by reference ((live index, view), ...).
Staged = torch.Tensor | tuple[tuple[tuple[Any, ...], torch.Tensor], ...]
KV_SCALES = ("q_scale", "k_scale", "v_scale", "prob_scale")
KV_PLACEHOLDER = -1.0  # what a loader leaves in an uncalibrated scale
_KV_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.((?:q|k|v|prob)_scale)$")


def _finite(t: torch.Tensor) -> bool:
    """NaN and Inf propagate into the minimum and maximum: one pass, no boolean temporary."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.reshape(-1))
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _commit_mode(value: str | CommitMode) -> CommitMode:
    return CommitMode.parse(value)


@attrs.define
class ReferenceEngine:
    """A RolloutEngine on CPU (or any torch device) for the reference model.

    Attributes:
        config: the model's shapes.
        plan: the rollout quantization plan (fixes the live layout, as an engine's start does).
        commit_mode: transactional or per-layer.
        kv_cache_scheme: the quantization config's `kv_cache_scheme` (None = uncalibrated).
        reset_kv_scales: reset placeholder KV-cache scales after a quantized refit (turning it
            off reproduces engines that leave the placeholders).
        verifiers: extra checks run on every commit group before it is committed.
        device: where the live weights, the staging and the forward live (a GPU: the refit's
            copies are device to device); log-probs come back on the host.
    """

    config: ReferenceModelConfig
    plan: QuantizationPlan = attrs.field(factory=QuantizationPlan.bf16)
    commit_mode: CommitMode = attrs.field(default=CommitMode.TRANSACTIONAL, converter=_commit_mode)
    kv_cache_scheme: Mapping[str, object] | None = None
    reset_kv_scales: bool = True
    verifiers: list[Verifier] = attrs.field(factory=list)
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"), converter=torch.device)
    layout: EngineLayout = attrs.field(init=False)
    postprocess_counts: dict[str, int] = attrs.field(init=False, factory=dict)
    refits_committed: int = attrs.field(init=False, default=0)
    _live: dict[str, dict[str, torch.Tensor]] = attrs.field(init=False)
    _kv: dict[str, torch.Tensor] = attrs.field(init=False)
    _guard: EngineGuard = attrs.field(init=False)
    _staged: dict[str, dict[str, torch.Tensor]] = attrs.field(init=False, factory=dict)
    # Staged by reference (retained buckets): key -> local -> [(index into the live tensor, view)].
    _refs: dict[str, dict[str, list[tuple[tuple[Any, ...], torch.Tensor]]]] = attrs.field(init=False, factory=dict)
    _staged_kv: dict[str, torch.Tensor] = attrs.field(init=False, factory=dict)
    _pending: dict[str, set[str]] = attrs.field(init=False, factory=dict)
    _received: set[str] = attrs.field(init=False, factory=set)
    _touched: bool = attrs.field(init=False, default=False)
    _committed: int = attrs.field(init=False, default=0)
    _staged_bytes: int = attrs.field(init=False, default=0)
    _peak_bytes: int = attrs.field(init=False, default=0)
    _post_seconds: float = attrs.field(init=False, default=0.0)
    _effective: dict[str, torch.Tensor] | None = attrs.field(init=False, default=None)
    _delta: DeltaReceiver | None = attrs.field(init=False, default=None)
    # LoRA adapters held (adapter mode, ports.lora_engine): id -> adapter (owned copies); the one served.
    _adapters: dict[int, LoraAdapter] = attrs.field(init=False, factory=dict)
    _serving_adapter: int | None = attrs.field(init=False, default=None)
    _next_adapter: int = attrs.field(init=False, default=1)

    def __attrs_post_init__(self) -> None:
        self._guard = EngineGuard(on_fail=self._fail)
        self.layout = EngineLayout.build(self.config, self.plan)
        self._live = {
            key: {local: torch.zeros(shape, dtype=dtype, device=self.device) for local, (shape, dtype) in m.live.items()}
            for key, m in self.layout.modules.items()
        }
        self._kv = {
            f"layers.{i}.attn.{s}": torch.ones((), dtype=torch.float32, device=self.device)
            for i in range(self.config.num_layers) for s in KV_SCALES
        }

    # --- queries ---------------------------------------------------------------------------

    @property
    def is_stale(self) -> bool:
        return self._guard.is_stale

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        """The live tensors by the engine's own names (`layers.0.qkv.weight_scale`, KV scales)."""
        flat = {f"{k}.{local}": t for k, m in self._live.items() for local, t in m.items()}
        return MappingProxyType(flat | self._kv)

    def storage_fingerprint(self) -> StorageFingerprint:
        return StorageFingerprint.of(dict(self.live_weights()))

    def delta_base(self) -> DeltaBase:
        """The delta receiver's copy (DeltaEngine port); the first call turns the receiver on."""
        if self._delta is None:
            self._delta = DeltaReceiver()
        return self._delta.base()

    @property
    def delta_receiver(self) -> DeltaReceiver | None:
        """The delta receiver (None until `delta_base` is first asked)."""
        return self._delta

    # --- lifecycle -------------------------------------------------------------------------

    def begin_refit(self, refit_id: int) -> None:
        self._guard.begin(refit_id)
        if self._delta is not None:
            self._delta.begin()
        self._received = set()
        self._staged, self._refs = {}, {}
        self._pending = {g: set(names) for g, names in self.layout.groups().items()}
        self._touched = False
        self._committed = 0
        self._peak_bytes = self._staged_bytes = 0
        self._post_seconds = 0.0
        self.postprocess_counts = {}
        self._staged_kv = (
            {n: torch.full((), KV_PLACEHOLDER) for n in self._kv} if self.plan.is_quantized else {}
        )

    def load_bucket(self, bucket: Bucket) -> None:
        self._guard.accept(bucket)
        try:
            named = unpack_bucket(bucket)
            for name, view in self._delta.receive(named) if self._delta is not None else named:
                self._stage(name, view, bucket.retained)
        except Exception as err:
            self._fail(f"loading bucket {bucket.index}: {err}")
            raise

    def finalize_refit(self) -> EngineFinalizeResult:
        self._guard.finalize()
        try:
            missing = [n for names in self._pending.values() for n in names]
            if missing:
                raise RefitVerificationFailed(
                    f"refit {self._guard.refit_id}: {len(missing)} tensors never arrived, e.g. "
                    f"{missing[:3]}; the trainer's stream does not match the engine's layout"
                )
            groups = [g for g in self.layout.groups() if any(k in self._staged or k in self._refs for k in self._keys(g))]
            ready = {g: self._postprocess(g) for g in groups}
            for g in groups:
                self._verify(g, ready[g])
            for g in groups:
                self._commit(g, ready[g])
            kv_reset = self._commit_kv()
        except Exception as err:
            self._fail(f"finalize: {err}")
            raise
        self._guard.commit()
        if self._delta is not None:
            self._delta.commit()
        self._effective = None
        self.refits_committed += 1
        return EngineFinalizeResult(kv_reset, self._post_seconds, self._committed, self._peak_bytes)

    def abort_refit(self, reason: str) -> None:
        self._guard.abort(reason)

    def mark_stale(self, reason: str) -> None:
        if self._delta is not None:  # the live weights are not the copy's any more
            self._delta.discard()
        self._guard.mark_stale(reason)

    # --- staging ---------------------------------------------------------------------------

    def _keys(self, group: str) -> list[str]:
        return [k for k, m in self.layout.modules.items() if m.group == group]

    def _stage(self, name: str, view: torch.Tensor, retained: bool = False) -> None:
        kv = _KV_NAME.match(name)
        if kv is not None and self.kv_cache_scheme is not None:  # calibrated KV-cache scales
            self._staged_kv[f"layers.{kv[1]}.attn.{kv[2]}"] = view.detach().reshape(()).float().clone()
            return
        target = self.layout.targets.get(name)
        if target is None:
            raise EngineTensorMismatch(f"tensor {name!r} has no place in the engine; check the plan")
        if name in self._received:
            raise EngineTensorMismatch(f"tensor {name!r} arrived twice in one refit")
        if tuple(view.shape) != target.shape or view.dtype != target.dtype:
            raise EngineTensorMismatch(
                f"tensor {name!r}: got {view.dtype} {tuple(view.shape)}, the engine expects "
                f"{target.dtype} {target.shape}; trainer and engine plans differ"
            )
        staged = self._staged.get(target.key, {})
        # By reference only where the committed tensor is exactly what arrived: global scales are
        # post-processed (tiny; copied) and extra verifiers are handed whole staged tensors.
        if retained and target.local != GLOBAL and not self.verifiers and target.local not in staged:
            self._refs.setdefault(target.key, {}).setdefault(target.local, []).append((target.index, view))
        else:
            into = self._staging(target.key, target.local)
            into[target.index].copy_(view)  # copied before the bucket is acknowledged
        self._received.add(name)
        group = self.layout.modules[target.key].group
        self._pending[group].discard(name)
        if self.commit_mode is CommitMode.PER_LAYER and not self._pending[group]:
            ready = self._postprocess(group)
            self._verify(group, ready)
            self._commit(group, ready)

    def _staging(self, key: str, local: str) -> torch.Tensor:
        """The staging tensor of one module's tensor, allocated on first use. Views staged by
        reference for it so far are copied in (a later bucket that is not retained)."""
        staged = self._staged.setdefault(key, {})
        if local not in staged:
            shape, dtype = self.layout.modules[key].staging()[local]
            staged[local] = t = torch.empty(shape, dtype=dtype, device=self.device)
            self._staged_bytes += t.numel() * t.element_size()
            self._peak_bytes = max(self._peak_bytes, self._staged_bytes)
            for index, view in self._refs.get(key, {}).pop(local, []):
                t[index].copy_(view)
        return staged[local]

    def _release(self, key: str) -> None:
        staged = self._staged.pop(key, None) or {}
        self._refs.pop(key, None)
        self._staged_bytes -= sum(t.numel() * t.element_size() for t in staged.values())

    def _postprocess(self, group: str) -> dict[str, dict[str, Staged]]:
        """Once per module and refit: fused NVFP4 shards' global scales -> their maximum."""
        t0 = time.perf_counter()
        ready: dict[str, dict[str, Staged]] = {}
        for key in self._keys(group):
            staged, refs = self._staged.get(key), self._refs.get(key)
            if staged is None and refs is None:
                continue
            self.postprocess_counts[key] = self.postprocess_counts.get(key, 0) + 1
            out: dict[str, Staged] = {local: tuple(pieces) for local, pieces in (refs or {}).items()}
            out.update(staged or {})
            if staged is not None and GLOBAL in staged:
                gs = staged[GLOBAL]
                out[GLOBAL] = top = gs.amax(dim=-1, keepdim=True)
                if not bool(torch.eq(gs, top).all()):
                    structlog.get_logger().warning("fused shards have different global scales; using the maximum", module=key)
            ready[key] = out
        self._post_seconds += time.perf_counter() - t0
        return ready

    def _verify(self, group: str, ready: dict[str, dict[str, Staged]]) -> None:
        for key, m in ready.items():
            for local, t in m.items():
                views = t if isinstance(t, tuple) else ((None, t),)
                for _, v in views:
                    if v.dtype in (torch.bfloat16, torch.float32, torch.float16) and not _finite(v):
                        name = f"{key}.{local}"
                        raise RefitVerificationFailed(f"staged tensor {name!r} holds NaN or Inf; nothing was committed")
        if self.verifiers:  # never staged by reference: every value is a whole tensor
            flat = {f"{k}.{local}": t for k, m in ready.items() for local, t in m.items()}
            for verify in self.verifiers:
                verify(group, MappingProxyType(flat))  # type: ignore[arg-type]

    def _commit(self, group: str, ready: dict[str, dict[str, Staged]]) -> None:
        for key, tensors in ready.items():
            for local, t in tensors.items():
                self._touched = True
                live = self._live[key][local]  # written in place: the captured storage stays
                if isinstance(t, tuple):
                    for index, view in t:  # straight from the retained bucket
                        live[index].copy_(view)
                else:
                    live.copy_(t)
                self._committed += 1
            self._release(key)

    def _commit_kv(self) -> int:
        """KV-cache scales after the refit; returns the attention layers reset to 1.0."""
        reset_layers = set()
        for name, value in self._staged_kv.items():
            if float(value) == KV_PLACEHOLDER:
                if self.kv_cache_scheme is not None:
                    continue  # calibrated config: keep the live scale
                if self.reset_kv_scales:
                    value = torch.ones(())
                    reset_layers.add(name.rsplit(".", 2)[0])
            self._kv[name].copy_(value)
        self._staged_kv = {}
        return len(reset_layers)

    def _fail(self, reason: str) -> None:
        for key in [*self._staged, *self._refs]:
            self._release(key)
        self._staged_kv = {}
        if self._delta is not None:  # patched in place while staging: no longer the live weights' copy
            self._delta.discard()
        refit_id = self._guard.refit_id
        stale = f"refit {refit_id} failed after live weights were written: {reason}" if self._touched else None
        self._guard.fail(stale_reason=stale)
        if stale is not None:
            self._effective = None
        structlog.get_logger().warning("refit aborted", refit_id=refit_id, reason=reason, stale=self.is_stale)

    # --- serving ---------------------------------------------------------------------------

    def effective_weights(self) -> dict[str, torch.Tensor]:
        """The weights the forward computes with: BF16, dequantized from the live storage."""
        if self._effective is None:
            eff = {}
            for key, m in self.layout.modules.items():
                live = self._live[key]
                if m.format.is_quantized:
                    q = QuantizedWeight(m.format, dict(live), m.shape, torch.bfloat16)
                    eff[key] = dequantize_weight(q, torch.bfloat16)
                else:
                    eff[key] = live["weight"]
            if self._serving_adapter is not None:
                self._merge_adapter(eff, self._adapters[self._serving_adapter])
            self._effective = eff
        return self._effective

    def _merge_adapter(self, eff: dict[str, torch.Tensor], adapter: LoraAdapter) -> None:
        """Fold the served adapter into the effective weights: each module's rows of its fused
        weight become PEFT's merge of them (`domain.lora.merge_weight`), in the effective dtype."""
        from domain.lora import merge_weight

        slots = slot_table(self.config)
        copied: set[str] = set()
        for module, w in adapter.modules.items():
            slot = slots[module]
            if slot.key not in copied:  # never write into the live storage a BF16 module serves from
                eff[slot.key] = eff[slot.key].clone()
                copied.add(slot.key)
            eff[slot.key][slot.rows] = merge_weight(module, eff[slot.key][slot.rows], w, adapter.scaling)

    # --- the adapter mode (ports.lora_engine) ---------------------------------------------------

    @property
    def serving_adapter(self) -> int | None:
        return self._serving_adapter

    def stage_adapter(self, adapter: LoraAdapter) -> StagedAdapter:
        """Hold an owned copy of `adapter` under a fresh id (LoraEngine port); nothing serves it yet."""
        try:
            adapter.check_base(dict(hf_weight_shapes(self.config)))
            if unknown := [m for m in adapter.modules if m not in slot_table(self.config) or ".experts." in m]:
                raise LoraError(unknown[0], "the engine applies adapters to dense projections only")
        except LoraError as err:
            raise AdapterUpdateFailed(str(err), self._serving_adapter) from err
        from domain.lora import LoraWeights
        from domain.lora.sync import StagedAdapter

        owned = {m: LoraWeights(w.lora_A.clone(), w.lora_B.clone()) for m, w in adapter.modules.items()}
        staged = StagedAdapter(self._next_adapter, adapter.nbytes)  # in process: the owned copies
        self._adapters[staged.adapter_id] = attrs.evolve(adapter, modules=owned)
        self._next_adapter += 1
        return staged

    def commit_adapter(self, staged: StagedAdapter) -> None:
        """Serve the staged adapter from now on and drop the previous one (LoraEngine port)."""
        if staged.adapter_id not in self._adapters:
            raise AdapterUpdateFailed(f"adapter {staged.adapter_id} is not staged", self._serving_adapter)
        previous, self._serving_adapter = self._serving_adapter, staged.adapter_id
        self._effective = None
        if previous is not None:
            self._adapters.pop(previous, None)

    def abort_adapter(self, staged: StagedAdapter) -> None:
        """Drop a staged adapter (idempotent; the served one is kept)."""
        if staged.adapter_id != self._serving_adapter:
            self._adapters.pop(staged.adapter_id, None)

    def _act(self, key: str, x: torch.Tensor) -> torch.Tensor:
        m = self.layout.modules[key]
        if not m.format.is_quantized:
            return x
        scheme = self.plan.effective_moe_activation if is_routed(key) else self.plan.effective_linear_activation
        return fake_quantize_activation(scheme, x, name=key, numerics=self.plan.numerics,
                                        scale_rule=self.plan.scale_rule)

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rollout log-probs and entropies, float32 [B, T - 1] (RolloutEngine port)."""
        self._guard.check_serving()
        check_input_ids(self.config, input_ids)
        ids = input_ids.to(self.device)
        logits = forward_logits(self.config, self.effective_weights(), ids, self._act)
        logp, entropy = log_probs_from_logits(logits, ids, temperature)
        return logp.cpu(), entropy.cpu()

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy continuations of token-id prompts (EngineInspection port); refused while stale
        or mid-refit."""
        self._guard.check_serving()
        for prompt in prompts:
            if not prompt or min(prompt) < 0 or max(prompt) >= self.config.vocab_size:
                raise ValueError(f"greedy: each prompt must be 1 or more token ids in [0, {self.config.vocab_size}), "
                                 f"got {list(prompt)[:8]}")
        out: dict[int, list[int]] = {}
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(i)
        for rows in by_length.values():  # prompts of one length decode as one batch
            ids = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=self.device)
            start = ids.shape[1]
            for _ in range(max_tokens):
                logits = forward_logits(self.config, self.effective_weights(), ids, self._act)
                ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            out.update({i: ids[k, start:].tolist() for k, i in enumerate(rows)})
        return [out[i] for i in range(len(prompts))]

    # --- inspection (EngineInspection port) ------------------------------------------------

    def digests(self) -> dict[str, str]:
        """sha256 of every live tensor, by the engine's own name."""
        return {name: tensor_digest(t) for name, t in self.live_weights().items()}

    def kv_scales(self) -> dict[str, list[float]]:
        """Each attention layer's [q, k, v, prob] scales (`layers.0.attn`, ...)."""
        return {f"layers.{i}.attn": [float(self._kv[f"layers.{i}.attn.{s}"]) for s in KV_SCALES]
                for i in range(self.config.num_layers)}

    def close(self) -> None:
        """Abort a refit in progress; afterwards every refit and request is refused with
        EngineClosed (the engine is tensors in this process: nothing else to release)."""
        self._guard.close()
