"""The model version registry: the only way weights move between stages.

Guarantees
----------
- A version is immutable and content-addressed: its id is the first 12 hex digits of the
  whole-version SHA-256 (over every tensor's name, dtype, shape and SHA-256 and every aux file's
  SHA-256). Publishing identical weights again returns the existing version.
- A version is either a full snapshot (safetensors shards of ``shard_mb``) or a lossless delta
  against its parent (see ``policy.registry.codec``). A snapshot is written every
  ``snapshot_every`` versions along a chain, and whenever the delta would not be smaller.
- Publishing is atomic: files are written aside, fsynced and renamed into place in one step; a
  publisher killed at any moment leaves no visible version, and concurrent publishers cannot
  clobber each other (see ``policy.registry.store``).
- Everything read is checked: the manifest's own checksum, each file's SHA-256, each frame's CRC,
  and each rebuilt tensor's SHA-256. Errors name the version, file and tensor; corrupted weights
  are never returned.

API
---
::

    from policy.registry import Registry

    reg = Registry("var/registry", cache_dir="var/cache/materialized")   # or "s3://bucket/reg"
    reg = Registry.from_settings(settings.registry)                       # the same, from rtrl.toml

    v0 = reg.publish("var/models/tiny", stage="init")                     # an HF directory
    v1 = reg.publish(model.state_dict(), parent=v0.id, stage="grpo", run="run-7",
                     metrics={"pass@1": 0.61}, on_event=hook)             # aux files from the parent
    # (or source_dir=hf_dir for config/tokenizer; snapshot=True forces a full snapshot)

    path = reg.materialize(v1.id)            # HF dir (cached) that transformers and vLLM load
    sd = reg.load_state_dict("candidate")    # dict[str, torch.Tensor] for in-process hot swaps
    reg.list(); reg.info(ref); reg.show(ref) # VersionInfo list / one / full manifest as dict
    reg.verify(ref_or_None)                  # VerifyReport(ok, checked, errors, warnings)
    reg.diff(a, b)                           # per-tensor changes and the delta size
    reg.promote(v1.id, "candidate"); reg.rollback("production")
    reg.channel("production") -> id | None;  reg.history("production") -> list of events
    reg.gc(keep=[...], keep_last=5, dry_run=False)

A *ref* is a version id, a unique prefix of one (4+ digits), a channel name, or ``latest``.

A state dict is stored exactly as given: publish the tensors ``save_pretrained`` would write (with
tied embeddings, ``model.state_dict()`` also holds ``lm_head.weight``; leave it out, or it is stored
as a tensor of its own). The registry keeps the last ``memory_cache`` versions' bits in memory (its
own copies), so publishing version N+1 against N, or loading N right after publishing it, decodes
nothing; tensors returned by ``load_state_dict`` are the caller's to modify.

Hooks: ``Registry(..., on_event=f)`` and the ``on_event`` argument of publish/promote/rollback
receive a :class:`RegistryEvent` (action, version, parent, channel, sha256, metrics) after the
change is committed, so that a caller can emit a ``model_version`` event; the registry does not
import the event bus.

Storage layout and commit protocols: ``policy.registry.store``. Retention: ``policy.registry.gc``.
"""

from policy.registry.errors import (
    BrokenChain,
    ChannelError,
    CorruptVersion,
    PublishError,
    RegistryError,
    VersionNotFound,
)
from policy.registry.registry import Registry, RegistryEvent, VersionInfo
from policy.registry.verify import VerifyReport

__all__ = [
    "BrokenChain",
    "ChannelError",
    "CorruptVersion",
    "PublishError",
    "Registry",
    "RegistryError",
    "RegistryEvent",
    "VerifyReport",
    "VersionInfo",
    "VersionNotFound",
]
