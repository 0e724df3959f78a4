"""`rtrl registry ...`: publish, materialise, inspect, verify, promote, roll back and gc model versions.

Every command that a script would read takes ``--json`` (one JSON document on stdout). Registry
errors exit with status 1 and the message (naming version, file and tensor) on stderr; a failed
``verify`` exits 1 after printing its report.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import typer

from policy.cli_settings import settings_or_exit

registry_app = typer.Typer(help="The model version registry: the only way weights move between stages.",
                           no_args_is_help=True)

_CONFIG = typer.Option(None, "--config", "-c", help="TOML settings file.")
_URL = typer.Option(None, "--url", help="Registry directory or fsspec URL (default: registry.url).")
_JSON = typer.Option(False, "--json", help="Print one JSON document.")


def _open(ctx: typer.Context, config: str | None, url: str | None):
    from policy.registry import Registry

    settings = settings_or_exit(ctx, config)
    overrides = {} if url is None else {"url": url}
    # progress bars only for a person watching: stderr is a terminal
    return Registry.from_settings(settings.registry.model_copy(update=overrides), progress=sys.stderr.isatty())


def _run(fn: Callable[[], Any]) -> Any:
    from policy.registry import RegistryError

    try:
        return fn()
    except (RegistryError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None


def _emit(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _line(info) -> str:
    tags = f"  [{', '.join(info.channels)}]" if info.channels else ""
    ratio = info.raw_bytes / max(info.stored_bytes, 1)
    return (f"{info.id}  {info.created_iso}  {info.kind:<8} depth {info.depth}  parent {info.parent or '-':<12}  "
            f"{_size(info.stored_bytes):>10} ({ratio:.1f}x)  stage {info.stage or '-'}{tags}")


def _metrics(pairs: list[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            if not sep or not key:
                raise ValueError
            out[key] = float(value)
        except ValueError:
            raise typer.BadParameter(f"--metric wants NAME=NUMBER, got {pair!r}") from None
    return out


@registry_app.command("publish")
def publish(
    ctx: typer.Context,
    hf_dir: str = typer.Argument(..., help="HF model directory (safetensors weights + config/tokenizer files)."),
    parent: str | None = typer.Option(None, "--parent", "-p", help="Parent version (id, prefix, channel, latest): "
                                      "stored as a delta against it when that is smaller."),
    stage: str | None = typer.Option(None, help="Producing stage (init, midtrain, grpo, online...)."),
    run: str | None = typer.Option(None, help="Producing run id."),
    metric: list[str] = typer.Option([], "--metric", "-m", help="NAME=NUMBER, repeatable."),
    snapshot: bool = typer.Option(False, "--snapshot", help="Store a full snapshot even if a delta is smaller."),
    as_json: bool = _JSON,
    url: str | None = _URL,
    config: str | None = _CONFIG,
) -> None:
    """Publish an HF directory as a new immutable version (atomic; identical content returns the existing id)."""
    reg = _open(ctx, config, url)
    info = _run(lambda: reg.publish(hf_dir, parent=parent, stage=stage, run=run, metrics=_metrics(metric),
                                    snapshot=snapshot))
    if as_json:
        _emit(info.to_dict())
    else:
        typer.echo(_line(info))


@registry_app.command("materialize")
def materialize(
    ctx: typer.Context,
    version: str = typer.Argument(..., help="Version id, unique prefix, channel name, or latest."),
    out_dir: str | None = typer.Argument(None, help="Output directory (default: the cache, registry.cache_dir)."),
    as_json: bool = _JSON,
    url: str | None = _URL,
    config: str | None = _CONFIG,
) -> None:
    """Rebuild a version (snapshot + delta chain, bit-exact) as an HF directory transformers and vLLM load."""
    reg = _open(ctx, config, url)
    path = _run(lambda: reg.materialize(version, out_dir))
    if as_json:
        _emit({"version": reg.resolve(version), "path": str(path)})
    else:
        typer.echo(str(path))


@registry_app.command("list")
def list_versions(ctx: typer.Context, as_json: bool = _JSON, url: str | None = _URL, config: str | None = _CONFIG) -> None:
    """Every version, oldest first, with the channels pointing at it."""
    reg = _open(ctx, config, url)
    infos = _run(reg.list)
    if as_json:
        _emit([i.to_dict() for i in infos])
        return
    if not infos:
        typer.echo(f"no versions in {reg.url}")
    for info in infos:
        typer.echo(_line(info))


@registry_app.command("show")
def show(
    ctx: typer.Context,
    version: str = typer.Argument(..., help="Version id, unique prefix, channel name, or latest."),
    as_json: bool = _JSON,
    url: str | None = _URL,
    config: str | None = _CONFIG,
) -> None:
    """A version's manifest: lineage, metrics, storage, tensors and files."""
    reg = _open(ctx, config, url)
    data = _run(lambda: reg.show(version))
    if as_json:
        _emit(data)
        return
    typer.echo(_line(_run(lambda: reg.info(version))))
    typer.echo(f"sha256 {data['sha256']}")
    if data["metrics"]:
        typer.echo("metrics " + ", ".join(f"{k}={v:g}" for k, v in sorted(data["metrics"].items())))
    typer.echo("stats " + ", ".join(f"{k}={v:g}" for k, v in sorted(data["stats"].items())))
    for f in data["files"]:
        typer.echo(f"  file {f['name']:<40} {f['role']:<8} {_size(f['bytes']):>10}")
    for t in data["tensors"]:
        typer.echo(f"  tensor {t['name']:<50} {t['dtype']:<5} {str(t['shape']):<16} {t['coding']}")


@registry_app.command("verify")
def verify(
    ctx: typer.Context,
    version: str | None = typer.Argument(None, help="One version (and the chain it needs); default: everything."),
    as_json: bool = _JSON,
    url: str | None = _URL,
    config: str | None = _CONFIG,
) -> None:
    """Re-read and check every byte: manifests, file SHA-256s, bit-exact rebuilds, channels. Exit 1 on a problem."""
    reg = _open(ctx, config, url)
    report = _run(lambda: reg.verify(version))
    if as_json:
        _emit(report.to_dict())
    else:
        for err in report.errors:
            typer.echo(f"ERROR {err}")
        for warn in report.warnings:
            typer.echo(f"warning {warn}")
        typer.echo(f"{'ok' if report.ok else 'FAILED'}: {len(report.checked)} version(s) verified, "
                   f"{len(report.errors)} error(s)")
    if not report.ok:
        raise typer.Exit(1)


@registry_app.command("diff")
def diff(
    ctx: typer.Context,
    a: str = typer.Argument(..., help="From version."),
    b: str = typer.Argument(..., help="To version."),
    as_json: bool = _JSON,
    url: str | None = _URL,
    config: str | None = _CONFIG,
) -> None:
    """Per-tensor changes from A to B and the size the delta codec stores for them."""
    reg = _open(ctx, config, url)
    data = _run(lambda: reg.diff(a, b))
    if as_json:
        _emit(data)
        return
    typer.echo(f"{data['a']} -> {data['b']}: {data['changed']}/{data['elements']} elements changed "
               f"({100 * data['changed_fraction']:.2f}%), delta {_size(data['delta_bytes'])} ({data['ratio']}x)")
    for t in data["tensors"]:
        if t["status"] != "same":
            extra = (f"{t['changed']} changed ({100 * t['changed_fraction']:.2f}%), max |d| "
                     f"{t.get('max_abs_change', 0):.3g}" if t["status"] == "changed" else "")
            typer.echo(f"  {t['status']:<8} {t['name']:<50} {extra}")


@registry_app.command("promote")
def promote(
    ctx: typer.Context,
    version: str = typer.Argument(..., help="Version id, unique prefix, channel name, or latest."),
    channel: str = typer.Option("candidate", "--channel", help="Channel to point at the version."),
    note: str | None = typer.Option(None, help="Why (kept in the channel history)."),
    as_json: bool = _JSON,
    url: str | None = _URL,
    config: str | None = _CONFIG,
) -> None:
    """Point a channel at a version, atomically; the previous version stays reachable by rollback."""
    reg = _open(ctx, config, url)
    info = _run(lambda: reg.promote(version, channel, note=note))
    if as_json:
        _emit({"channel": channel, "version": info.id})
    else:
        typer.echo(f"{channel} -> {info.id}")


@registry_app.command("rollback")
def rollback(
    ctx: typer.Context,
    channel: str = typer.Option("production", "--channel", help="Channel to roll back."),
    note: str | None = typer.Option(None, help="Why (kept in the channel history)."),
    as_json: bool = _JSON,
    url: str | None = _URL,
    config: str | None = _CONFIG,
) -> None:
    """Point a channel back at the version it had before its last promotion."""
    reg = _open(ctx, config, url)
    info = _run(lambda: reg.rollback(channel, note=note))
    if as_json:
        _emit({"channel": channel, "version": info.id})
    else:
        typer.echo(f"{channel} -> {info.id} (rolled back)")


@registry_app.command("history")
def history(
    ctx: typer.Context,
    channel: str = typer.Argument(..., help="Channel name."),
    as_json: bool = _JSON,
    url: str | None = _URL,
    config: str | None = _CONFIG,
) -> None:
    """Every promote and rollback of a channel, oldest first."""
    reg = _open(ctx, config, url)
    events = _run(lambda: reg.history(channel))
    if as_json:
        _emit({"channel": channel, "current": _run(lambda: reg.channel(channel)), "history": events})
        return
    from datetime import UTC, datetime

    for e in events:
        when = datetime.fromtimestamp(e["at"], UTC).isoformat(timespec="seconds")
        typer.echo(f"{when}  {e['action']:<9} {e['previous'] or '-':<12} -> {e['version']}  {e['note'] or ''}")


@registry_app.command("gc")
def gc(
    ctx: typer.Context,
    keep: list[str] = typer.Option([], "--keep", help="Versions to keep besides channels and the newest (repeatable)."),
    keep_last: int | None = typer.Option(None, "--keep-last", help="Newest versions to keep (default: registry.keep_last)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only report what would be deleted."),
    as_json: bool = _JSON,
    url: str | None = _URL,
    config: str | None = _CONFIG,
) -> None:
    """Delete versions no channel, --keep or the newest need (their delta chains are kept), and dead staging."""
    reg = _open(ctx, config, url)
    report = _run(lambda: reg.gc(keep, keep_last=keep_last, dry_run=dry_run))
    if as_json:
        _emit(report)
        return
    verb = "would delete" if dry_run else "deleted"
    typer.echo(f"{verb} {len(report['deleted'])} version(s) ({_size(report['freed_bytes'])}), kept "
               f"{len(report['kept'])}; removed {len(report['staging_removed'])} abandoned staging dir(s)")
    for v in report["deleted"]:
        typer.echo(f"  {v}")


def register(app: typer.Typer) -> None:
    app.add_typer(registry_app, name="registry")
