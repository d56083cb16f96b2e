"""Per-device JSON cache of tuned kernel launch configs (written by ``hisparse-triton tune``).

Where the cache lives (first that applies):

1. ``$HISPARSE_TRITON_TUNING_CACHE``: a file path used as is for every device, or, when it
   names an existing directory (or ends with ``/``), the directory that holds the per-device
   files; ``off`` disables the cache (``lookup`` always answers ``None``: built-in defaults);
2. ``$XDG_CACHE_HOME/hisparse-triton/tuning-<device-slug>.json``;
3. ``~/.cache/hisparse-triton/tuning-<device-slug>.json``.

``<device-slug>`` is the GPU name in lower case with every run of other characters than
letters and digits replaced by ``-`` (``NVIDIA H200`` -> ``nvidia-h200``); ``cpu`` without
CUDA.

File format (``SCHEMA``, ``VERSION``)::

    {"schema": "hisparse-triton/tuning-cache", "version": 1, "device": "NVIDIA H200",
     "entries": {"gather:656:4": {"kernel": "gather", "row_bytes": 656, "num_layers": 4,
                                  "config": {"num_warps": 4, ...},
                                  "time_us": 91.2, "gbps": 47.1, ...}}}

An entry is keyed by kernel family, row bytes and layers per launch; ``config`` holds the
launch parameters (JSON scalars), the other fields are what the tuner measured. A file that
cannot be read, is not JSON, or has another schema or version is reported with a
``TuningCacheWarning`` and ignored (no tuned entries: the defaults apply); a malformed entry
is reported and skipped. Nothing here raises on a bad file.

``lookup(kernel, row_bytes, num_layers)`` is what the launch-config code calls at start-up:
the file is read once per path and memoised (``invalidate()`` forgets it). Without an entry
for the exact shape it takes the *nearest* tuned shape of the same kernel and row size (the
layer count nearest on a log scale: a 61-layer mirror uses the 64- or 32-layer entry rather
than the built-in default); a config tuned for another row size is not used (the best tile
depends on it). Each shape that is not found exactly is logged once (``logging``, logger
``hisparse_triton.tuning_cache``): INFO when a nearest entry stands in, WARNING when the
device has tuned entries but none for this kernel and row size, DEBUG when there is no
cache at all.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional, TypeVar

#: Environment variable overriding the cache location (a file, or a directory).
ENV_VAR = "HISPARSE_TRITON_TUNING_CACHE"
#: ``schema`` field of a cache file.
SCHEMA = "hisparse-triton/tuning-cache"
#: ``version`` field of a cache file; a file of another version is ignored.
VERSION = 1

T = TypeVar("T")

_LOG = logging.getLogger(__name__)


class TuningCacheWarning(UserWarning):
    """A tuning cache file (or entry) could not be used and was ignored."""


def device_slug(device_name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``: the device part of the cache file name."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return slug or "unknown-device"


def current_device_name() -> str:
    """Name of the current CUDA device (``torch.cuda.get_device_name``), ``"cpu"`` without one."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(torch.cuda.current_device())


def disabled() -> bool:
    """``True`` when ``$HISPARSE_TRITON_TUNING_CACHE`` is ``off``: no tuned configs are used."""
    return os.environ.get(ENV_VAR, "").strip().lower() == "off"


def cache_dir() -> Path:
    """The per-user cache directory (``$XDG_CACHE_HOME/hisparse-triton`` or ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME")
    root = Path(base) if base else Path.home() / ".cache"
    return root / "hisparse-triton"


def cache_path(device_name: Optional[str] = None) -> Path:
    """The cache file for ``device_name`` (default: the current device); see the module doc."""
    name = device_name if device_name is not None else current_device_name()
    file_name = f"tuning-{device_slug(name)}.json"
    override = os.environ.get(ENV_VAR)
    if override and not disabled():
        target = Path(override).expanduser()
        if override.endswith(("/", os.sep)) or target.is_dir():
            return target / file_name
        return target
    return cache_dir() / file_name


def entry_key(kernel: str, row_bytes: int, num_layers: int) -> str:
    """Key of an entry: ``"<kernel>:<row_bytes>:<num_layers>"``."""
    return f"{kernel}:{row_bytes}:{num_layers}"


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


@dataclass
class TuningEntry:
    """One tuned launch config and what the tuner measured for it.

    - ``config``: launch parameters (field name -> JSON scalar), e.g. ``{"num_warps": 4}``.
    - ``metrics``: everything else the tuner recorded (``time_us``, ``gbps``,
      ``default_time_us``, ``rows``, versions, ``tuned_at``...), JSON values.
    """

    kernel: str
    row_bytes: int
    num_layers: int
    config: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, str) or not self.kernel:
            raise ValueError(f"tuning entry kernel must be a non-empty string, "
                             f"got {self.kernel!r}.")
        for name in ("row_bytes", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"tuning entry {name} must be a positive int, got {value!r}.")
        if not isinstance(self.config, dict) or not all(
                isinstance(k, str) and _is_scalar(v) for k, v in self.config.items()):
            raise ValueError(f"tuning entry config must map names to JSON scalars, "
                             f"got {self.config!r}.")
        if not isinstance(self.metrics, dict):
            raise ValueError(f"tuning entry metrics must be a dict, got {self.metrics!r}.")

    @property
    def key(self) -> str:
        return entry_key(self.kernel, self.row_bytes, self.num_layers)

    def to_json(self) -> dict[str, Any]:
        return {**self.metrics, "kernel": self.kernel, "row_bytes": self.row_bytes,
                "num_layers": self.num_layers, "config": dict(self.config)}

    @classmethod
    def from_json(cls, data: Any) -> "TuningEntry":
        if not isinstance(data, dict):
            raise ValueError(f"an entry must be a JSON object, got {type(data).__name__}")
        missing = [k for k in ("kernel", "row_bytes", "num_layers", "config") if k not in data]
        if missing:
            raise ValueError(f"entry lacks {', '.join(missing)}")
        metrics = {k: v for k, v in data.items()
                   if k not in ("kernel", "row_bytes", "num_layers", "config")}
        return cls(kernel=data["kernel"], row_bytes=data["row_bytes"],
                   num_layers=data["num_layers"], config=data["config"], metrics=metrics)


class TuningCache:
    """The tuned entries of one device, backed by one JSON file.

    ``TuningCache.load(path)`` never raises on a bad file (it warns and starts empty);
    ``save()`` writes atomically (temporary file + rename), creating the directory.
    """

    def __init__(self, path: Path, device: str, entries: Optional[dict[str, TuningEntry]] = None,
                 *, problem: Optional[str] = None) -> None:
        self.path = Path(path)
        self.device = device
        self.entries: dict[str, TuningEntry] = dict(entries or {})
        #: Why the file on disk was ignored (``None`` when it was read or did not exist).
        self.problem = problem

    @classmethod
    def load(cls, path: Optional[Path] = None, *, device_name: Optional[str] = None,
             warn: bool = True) -> "TuningCache":
        """Read ``path`` (default: ``cache_path(device_name)``); a bad file warns, loads empty."""
        name = device_name if device_name is not None else current_device_name()
        path = Path(path) if path is not None else cache_path(name)
        if not path.exists():
            return cls(path, name)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return cls._ignored(path, name, f"it is not readable JSON ({exc})", warn)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            return cls._ignored(path, name, f"it is not a {SCHEMA!r} file", warn)
        if data.get("version") != VERSION:
            return cls._ignored(path, name, f"its version {data.get('version')!r} is not "
                                f"{VERSION}", warn)
        raw = data.get("entries")
        if not isinstance(raw, dict):
            return cls._ignored(path, name, "its 'entries' is not a JSON object", warn)
        entries: dict[str, TuningEntry] = {}
        for key, value in raw.items():
            try:
                entry = TuningEntry.from_json(value)
            except (ValueError, TypeError) as exc:
                if warn:
                    warnings.warn(f"hisparse-triton: ignoring tuning cache entry {key!r} in "
                                  f"{path}: {exc}.", TuningCacheWarning, stacklevel=2)
                continue
            if entry.key != key:
                if warn:
                    warnings.warn(f"hisparse-triton: ignoring tuning cache entry {key!r} in "
                                  f"{path}: its fields say {entry.key!r}.",
                                  TuningCacheWarning, stacklevel=2)
                continue
            entries[key] = entry
        device = data.get("device") if isinstance(data.get("device"), str) else name
        return cls(path, device, entries)

    @classmethod
    def _ignored(cls, path: Path, name: str, why: str, warn: bool) -> "TuningCache":
        message = (f"hisparse-triton: ignoring tuning cache {path}: {why}. Default launch "
                   f"configs are used; `hisparse-triton tune` rewrites the file.")
        if warn:
            warnings.warn(message, TuningCacheWarning, stacklevel=3)
        return cls(path, name, problem=why)

    def get(self, kernel: str, row_bytes: int, num_layers: int) -> Optional[TuningEntry]:
        """The entry of exactly this shape, or ``None``."""
        return self.entries.get(entry_key(kernel, row_bytes, num_layers))

    def nearest(self, kernel: str, row_bytes: int, num_layers: int) -> Optional[TuningEntry]:
        """The exact entry, else the entry of the same kernel and row size whose layer count
        is nearest on a log scale (a tie goes to the larger count), else ``None``."""
        exact = self.get(kernel, row_bytes, num_layers)
        if exact is not None:
            return exact
        same = [e for e in self.entries.values()
                if e.kernel == kernel and e.row_bytes == row_bytes]
        if not same:
            return None
        return min(same, key=lambda e: (abs(math.log2(e.num_layers / max(num_layers, 1))),
                                        -e.num_layers))

    def put(self, entry: TuningEntry) -> None:
        """Add or replace the entry with ``entry``'s key (in memory; ``save()`` writes)."""
        self.entries[entry.key] = entry

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "version": VERSION, "device": self.device,
                "entries": {k: self.entries[k].to_json() for k in sorted(self.entries)}}

    def save(self) -> Path:
        """Write the cache atomically; a file ignored on load is kept as ``<name>.bad``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.problem is not None and self.path.exists():
            os.replace(self.path, self.path.with_name(self.path.name + ".bad"))
            self.problem = None
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp",
                                   dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(self.to_json(), handle, indent=2, sort_keys=False)
                handle.write("\n")
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        invalidate()
        return self.path


def now_iso() -> str:
    """UTC time stamp for ``tuned_at`` fields."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


#: Memoised caches by resolved file path (``lookup`` reads each file once).
_MEMO: dict[Path, TuningCache] = {}
#: Shapes already logged by ``lookup`` (one message per cache file and shape).
_LOGGED: set[tuple[Path, str]] = set()


def invalidate() -> None:
    """Forget the memoised caches (and which shapes were logged): the next ``lookup`` reads
    the file again."""
    _MEMO.clear()
    _LOGGED.clear()


def load_current(device_name: Optional[str] = None) -> TuningCache:
    """The memoised cache of ``device_name`` (default: the current device)."""
    name = device_name if device_name is not None else current_device_name()
    path = cache_path(name)
    cache = _MEMO.get(path)
    if cache is None:
        cache = TuningCache.load(path, device_name=name)
        _MEMO[path] = cache
    return cache


def _log_once(cache: TuningCache, key: str, level: int, message: str) -> None:
    if (cache.path, key) in _LOGGED:
        return
    _LOGGED.add((cache.path, key))
    _LOG.log(level, message)


def lookup(kernel: str, row_bytes: int, num_layers: int, *,
           device_name: Optional[str] = None, nearest: bool = True) -> Optional[dict[str, Any]]:
    """The tuned launch config of ``kernel`` for rows of ``row_bytes`` and ``num_layers``
    layers per launch on the current device, or ``None`` (the built-in default applies).

    ``nearest`` (default): without an exact entry, the nearest tuned shape of the same
    kernel and row size (``TuningCache.nearest``); every inexact answer is logged once.
    Never raises because of the file: a bad file warns once (per path) and yields ``None``.
    """
    if disabled():
        return None
    cache = load_current(device_name)
    key = entry_key(kernel, row_bytes, num_layers)
    entry = cache.get(kernel, row_bytes, num_layers)
    if entry is not None or not nearest:
        return dict(entry.config) if entry is not None else None
    entry = cache.nearest(kernel, row_bytes, num_layers)
    if entry is not None:
        _log_once(cache, key, logging.INFO,
                  f"hisparse-triton: no tuned launch config for {key} in {cache.path}; using "
                  f"the nearest tuned shape {entry.key}.")
        return dict(entry.config)
    if cache.entries:
        _log_once(cache, key, logging.WARNING,
                  f"hisparse-triton: no tuned launch config for {kernel} with {row_bytes} B "
                  f"rows in {cache.path} (it has {', '.join(sorted(cache.entries))}); the "
                  f"built-in default is used for {key}. `hisparse-triton tune --kernel "
                  f"{kernel} --row-bytes {row_bytes}` tunes it.")
    else:
        _log_once(cache, key, logging.DEBUG,
                  f"hisparse-triton: no tuning cache at {cache.path}; the built-in default is "
                  f"used for {key}.")
    return None


def config_from_entry(cls: type[T], config: Mapping[str, Any], *,
                      source: str = "tuning cache") -> Optional[T]:
    """Build the dataclass ``cls`` from a cached ``config`` dict, or ``None`` (with a warning)
    when the names or values do not fit ``cls`` (e.g. a cache written by another version).
    Unnamed fields keep ``cls``'s defaults."""
    if not is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    names = {f.name for f in fields(cls) if f.init}
    unknown = sorted(set(config) - names)
    if unknown:
        warnings.warn(f"hisparse-triton: ignoring {cls.__name__} from the {source}: unknown "
                      f"field(s) {', '.join(unknown)}.", TuningCacheWarning, stacklevel=2)
        return None
    try:
        return cls(**config)
    except (TypeError, ValueError) as exc:
        warnings.warn(f"hisparse-triton: ignoring {cls.__name__} from the {source}: {exc}.",
                      TuningCacheWarning, stacklevel=2)
        return None


def lookup_config(cls: type[T], kernel: str, row_bytes: int, num_layers: int) -> Optional[T]:
    """``lookup`` + ``config_from_entry``: the tuned ``cls`` instance or ``None``."""
    config = lookup(kernel, row_bytes, num_layers)
    return None if config is None else config_from_entry(cls, config)
