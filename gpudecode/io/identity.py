"""A run's identity, stored with its results: what produced them, so that ``--resume`` can refuse to
mix results of different configs or models.

The identity (``run-identity.json`` in the output folder) holds the toolkit version, the resolved
config without the keys that never change the results (:data:`NOT_IN_IDENTITY`), and the SHA-256
of every file the ``models`` and ``scorers`` sections name (a model folder: of every file in it; a
custom scorer's ``base_dir`` compares by path).
A model file compares by content: the same file at another path is the same model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpudecode import defaults
from gpudecode.io.errors import ResultFileError

__all__ = ["NOT_IN_IDENTITY", "archive_number", "identity_differences", "read_identity", "run_identity",
           "write_identity"]

#: Config keys left out of the identity: where the results go, the references (the WER is computed
#: again over every result at the end), where and how fast the run goes (engine, memory limits, CUDA
#: graphs, batching and the search's speed settings); none of them changes a result.
NOT_IN_IDENTITY = (
    "io.output", "io.references", "runtime.dump_inputs", "runtime.engine", "runtime.cuda_graphs",
    "runtime.ort_arena_limit_bytes", "runtime.cupy_pool_limit_bytes", "runtime.prefetch_batches",
    "runtime.writer_queue", "runtime.writer_process", "runtime.processes", "search.batch_size", "search.batch_frames", "search.max_active_utterances",
    "search.admission_order", "search.tuning",
)
#: Sections whose paths name models (hashed), unlike the inputs and outputs of ``io``.
_HASHED_SECTIONS = ("models", "scorers")
_MISSING = object()
_CHUNK_BYTES = 1 << 20
#: At most this many differences are listed in a refusal (then a count of the rest).
_MAX_LISTED = 20


def _key(parts: list[str | int]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _sha256(path: Path) -> str:
    """The file's SHA-256; of a folder, the SHA-256 of its files' relative paths and hashes."""
    digest = hashlib.sha256()
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{file.relative_to(path).as_posix()}\0{_sha256(file)}\n".encode())
        return digest.hexdigest()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
    except OSError as exc:
        raise ResultFileError(f"cannot read to hash it for the run's identity: {exc.strerror}", path=path) from exc
    return digest.hexdigest()


def _plain(value: Any, parts: list[str | int], files: dict[str, dict]) -> Any:
    """``value`` as JSON data without the excluded keys; files in hashed sections go to ``files``."""
    key = _key(parts)
    if isinstance(value, Mapping):
        dotted = ".".join(map(str, parts))
        return {k: _plain(v, [*parts, k], files) for k, v in value.items()
                if (f"{dotted}.{k}" if dotted else k) not in NOT_IN_IDENTITY}
    if isinstance(value, (list, tuple)):
        return [_plain(v, [*parts, i], files) for i, v in enumerate(value)]
    hashed = parts and parts[0] in _HASHED_SECTIONS and "base_dir" not in parts  # not a custom scorer's folder
    if isinstance(value, Path) or (hashed and "options" in parts and isinstance(value, str)
                                   and os.path.isabs(value) and os.path.isfile(value)):
        if hashed and Path(value).exists():
            files[key] = {"path": str(value), "sha256": _sha256(Path(value))}
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def run_identity(settings: Mapping[str, Any], version: str) -> dict:
    """The identity of a run of the resolved config ``settings`` (``Config.model_dump()``: paths as
    ``Path``) with toolkit ``version``, as JSON data."""
    files: dict[str, dict] = {}
    config = _plain(settings, [], files)
    return {"gpudecode": version, "config": config, "files": files}


def read_identity(folder: str | Path) -> dict | None:
    """The identity stored in ``folder``, or None where there is none (a run of an older version)."""
    path = Path(folder) / defaults.IDENTITY_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ResultFileError(f"cannot read the run's identity: {exc.strerror}", path=path) from exc
    except ValueError as exc:
        raise ResultFileError(f"not a run identity (invalid JSON: {exc}); move it away to resume without "
                              "the check", path=path) from exc
    if not isinstance(data, dict) or not {"gpudecode", "config", "files"} <= data.keys():
        raise ResultFileError("not a run identity (keys gpudecode, config, files expected); move it away to "
                              "resume without the check", path=path)
    return data


def write_identity(folder: str | Path, identity: Mapping) -> Path:
    """Write ``identity`` to ``folder`` (atomically: a killed run leaves the old file or the new)."""
    path = Path(folder) / defaults.IDENTITY_FILE
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(identity, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        exc.filename = str(path)  # the file the user knows, not the temporary one
        raise
    return path


def archive_number(folder: str | Path) -> int:
    """The next free ``n`` of ``config.resolved.<n>.yaml`` / ``run-identity.<n>.json`` in ``folder``,
    where a previous run's resolved config and identity are kept."""
    used = [0]
    for name in (defaults.RESOLVED_CONFIG_FILE, defaults.IDENTITY_FILE):
        stem, _, suffix = name.rpartition(".")
        for path in Path(folder).glob(f"{stem}.*.{suffix}"):
            middle = path.name[len(stem) + 1:-len(suffix) - 1]
            if middle.isdigit():
                used.append(int(middle))
    return max(used) + 1


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(none)"
    if isinstance(value, dict):  # a whole section or scorer: what names it
        named = [f"{k}: {value[k]}" for k in ("type", "name", "model", "path") if value.get(k) is not None]
        text = "{" + ", ".join(named) + (", ...}" if named else "...}")
    else:
        text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 100 else text[:97] + "..."


def _named(items: Any) -> bool:
    """A list of sections with distinct names (the scorers)."""
    return (isinstance(items, list) and all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items)
            and len({i["name"] for i in items}) == len(items))


class _Differ:
    """Walks two identities' configs side by side; model files (hashed on both sides) compare by content."""

    def __init__(self, old_files: Mapping[str, dict], new_files: Mapping[str, dict]):
        self.old_files, self.new_files = old_files, new_files
        self.lines: list[str] = []

    def diff(self, old: Any, new: Any, old_parts: list, new_parts: list) -> None:
        """``*_parts``: the key on each side (scorers matched by name may sit at other indices)."""
        key, old_key = _key(new_parts), _key(old_parts)
        if old_key in self.old_files and key in self.new_files:
            was, now = self.old_files[old_key], self.new_files[key]
            if was.get("sha256") != now.get("sha256"):
                where = now["path"] if was.get("path") == now["path"] else f"{was.get('path')} → {now['path']}"
                self.lines.append(f"{key}: different file content ({where}; SHA-256 {str(was.get('sha256'))[:12]}… "
                                  f"→ {now['sha256'][:12]}…)")
        elif isinstance(old, dict) and isinstance(new, dict):
            for k in [*old, *(k for k in new if k not in old)]:
                self.diff(old.get(k, _MISSING), new.get(k, _MISSING), [*old_parts, k], [*new_parts, k])
        elif _named(old) and _named(new):  # scorers: matched by name, so that one removed is one line
            new_index = {item["name"]: j for j, item in enumerate(new)}
            old_names = {item["name"] for item in old}
            for i, item in enumerate(old):
                j = new_index.get(item["name"])
                self.diff(item, _MISSING if j is None else new[j], [*old_parts, i],
                          [*new_parts, i if j is None else j])
            for j, item in enumerate(new):
                if item["name"] not in old_names:
                    self.diff(_MISSING, item, [*old_parts, j], [*new_parts, j])
        elif isinstance(old, list) and isinstance(new, list):
            for i in range(max(len(old), len(new))):
                self.diff(old[i] if i < len(old) else _MISSING, new[i] if i < len(new) else _MISSING,
                          [*old_parts, i], [*new_parts, i])
        elif old != new:
            self.lines.append(f"{key}: {_show(old)} → {_show(new)}")


def identity_differences(old: Mapping, new: Mapping) -> list[str]:
    """What differs from identity ``old`` to ``new``, one line each (empty: the same run): config keys
    (``key: old → new``), model files whose content changed (a file at another path with the same
    content is the same), the toolkit version."""
    lines = []
    if old.get("gpudecode") != new.get("gpudecode"):
        lines.append(f"gpudecode version: {old.get('gpudecode')} → {new.get('gpudecode')}")
    differ = _Differ(old.get("files", {}), new.get("files", {}))
    differ.diff(old.get("config", {}), new.get("config", {}), [], [])
    lines += differ.lines
    if len(lines) > _MAX_LISTED:
        lines = [*lines[:_MAX_LISTED], f"... and {len(lines) - _MAX_LISTED} more"]
    return lines
