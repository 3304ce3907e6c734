"""Finished runs kept on disk, keyed by everything that determines them; identical requests computed once.

A run of the lab (a model, a document, a question, a method with its knobs,
a ratio, an answer length) gives the same result every time, so a server
that has computed one never needs to compute it again: :class:`ResultStore`
answers it from memory or disk without the compute slot, and two requests
for the same configuration while it is being computed share that one
computation (kvlab.memo.compute_once).

What a key holds (:class:`RunKey`): the model's identity (the digest of its
weights file or folder, or a hub revision: :func:`model_identity`), the
document's sha256, the question, the method, every option of the method
(defaults included), the ratio, the answer length and the code's identity
(kvlab's version and a digest of its source: a changed library may compute
other numbers, so its results are not reused).

On disk (``KVLAB_STORE_DIR``, see kvlab.limits.store_dir): one file per
entry, ``<digest[:2]>/<digest>.run``: a magic line, one line of JSON (the
key in full and the payload's sha256) and the payload (a pickle). Writes
go to a temporary file in the same folder and are renamed into place, so a
crash leaves no half entry. An entry whose key, checksum or format does not
match is ignored (and removed) and the run is computed again: a damaged or
foreign entry is never shown. Least recently used entries go while the
folder holds more than ``KVLAB_STORE_BYTES``. The payload is a pickle: the
folder must be the server's own (it is created readable by its owner only).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import tempfile
import threading
from collections import Counter, OrderedDict
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Hashable, Literal

from kvlab import limits
from kvlab.memo import MISSING, compute_once
from kvlab.runtime.model import LoadedModel

log = logging.getLogger("kvlab.results")

#: The first line of every entry; a new layout gets a new number (older entries are then ignored).
MAGIC = b"kvlab-result 1\n"
SUFFIX = ".run"
#: Finished runs kept in memory as well (most recently used), in pickled bytes.
MEMORY_BYTES = 256 * 1024 * 1024
#: How a request was answered: from the store, computed by it, or shared with an identical request in flight.
Served = Literal["stored", "computed", "shared"]
_CHUNK = 1 << 20


@dataclass(frozen=True)
class RunKey:
    """Everything a finished run depends on (see the module's docstring)."""

    model: str
    document: str
    question: str
    method: str
    options: str
    ratio: float
    max_new_tokens: int
    code: str

    def canonical(self) -> str:
        """The key as one line of JSON, keys sorted: what the entry's header must repeat exactly."""
        return json.dumps(asdict(self), sort_keys=True)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()


def text_digest(text: str) -> str:
    """A document's identity: the sha256 of its text."""
    return hashlib.sha256(text.encode()).hexdigest()


@lru_cache(maxsize=None)
def code_identity() -> str:
    """kvlab's version and the sha256 of its Python source (every ``kvlab/**/*.py``, by relative path)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    try:
        version = metadata.version("kvlab")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version}+{h.hexdigest()[:16]}"


_digests: dict[tuple[str, int, int], str] = {}
_digests_lock = threading.Lock()


def file_digest(path: Path) -> str:
    """The sha256 of a file, computed once per (path, size, modification time) in this process."""
    stat = path.stat()
    ident = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _digests_lock:
        if ident in _digests:
            return _digests[ident]
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    with _digests_lock:
        _digests[ident] = h.hexdigest()
    return _digests[ident]


def folder_digest(path: Path) -> str:
    """The sha256 over every file of a folder (names and contents, hidden files skipped)."""
    h = hashlib.sha256()
    for file in sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ):
        h.update(file.relative_to(path).as_posix().encode() + b"\0" + file_digest(file).encode())
    return h.hexdigest()


def hub_revision(repo_id: str) -> str | None:
    """The revision of a hub model in the local hub cache (its snapshot folder's name), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - an id the hub library refuses has no revision here
        return None
    if not isinstance(found, str):
        return None
    return Path(found).parent.name


def model_identity(spec: str | None) -> str:
    """What identifies a model's weights: the digest of its GGUF file or folder, or its hub revision.

    A hub model not in the local cache yet is "<id>@unresolved" (its first
    load fetches it; later calls find the revision).
    """
    from kvlab.models import resolve_source

    source = resolve_source(spec)
    location = Path(source.location)
    if source.digest:  # a packaged GGUF, checked by its sha256 when it was assembled
        return "gguf:" + source.digest
    if source.gguf_file:
        return "gguf:" + file_digest(location / source.gguf_file)
    if location.is_dir():
        return "folder:" + folder_digest(location)
    return f"hub:{source.location}@{hub_revision(source.location) or 'unresolved'}"


def loaded_identity(lm: LoadedModel) -> str:
    """What identifies a loaded model's weights when no file names them (a model built in code, any model
    handed to the lab): its name, its configuration and a digest of the first 4,096 values of its token
    embedding (a slice moved to the CPU only to be hashed: two trainings, or two random seeds, differ there)."""
    weight = lm.model.get_input_embeddings().weight.detach().flatten()[: 1 << 12]
    digest = hashlib.sha256(weight.float().cpu().numpy().tobytes())
    digest.update(lm.model.config.to_json_string().encode())
    return f"loaded:{lm.name}:{digest.hexdigest()[:32]}"


def options_text(options: object) -> str:
    """A method's options as canonical text (every field, defaults included; dataclass or mapping)."""
    values = asdict(options) if hasattr(options, "__dataclass_fields__") else dict(options)  # type: ignore[call-overload]
    return json.dumps(values, sort_keys=True, default=repr)


class ResultStore:
    """Finished runs by :class:`RunKey`, in memory and (when ``directory`` is usable) on disk; thread-safe.

    directory: where entries live (None: memory only). A folder that cannot be
    created or written is reported in one log line and the store keeps
    results in memory only; the server serves on. max_bytes: the disk budget.
    counts: requests answered per :data:`Served` kind (tests and benchmarks read it).
    """

    def __init__(self, directory: Path | None, max_bytes: int = 2 << 30, memory_bytes: int = MEMORY_BYTES):
        self.max_bytes = max_bytes
        self.memory_bytes = memory_bytes
        self._memory: OrderedDict[str, tuple[object, int]] = OrderedDict()
        self._memory_total = 0
        self._flights: dict[Hashable, Future] = {}
        self._lock = threading.Lock()
        self._disk_lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.directory = self._usable(directory)

    @staticmethod
    def _usable(directory: Path | None) -> Path | None:
        if directory is None:
            return None
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
                pass
        except OSError as exc:
            log.warning(
                "the result store %s is not usable (%s): finished runs are kept in memory only "
                "(set KVLAB_STORE_DIR to a writable folder, or to 'off')",
                directory,
                exc.strerror or exc,
            )
            return None
        return directory

    def path(self, key: RunKey) -> Path | None:
        """The file of ``key``'s entry (None: memory only)."""
        if self.directory is None:
            return None
        digest = key.digest
        return self.directory / digest[:2] / f"{digest}{SUFFIX}"

    # ------------------------------------------------------------------ lookups
    def get(self, key: RunKey) -> Any:
        """The stored value of ``key``, or kvlab.memo.MISSING (memory first, then disk)."""
        with self._lock:
            found = self._from_memory(key.digest)
        if found is not MISSING:
            return found
        payload = self._read(key)
        if payload is None:
            return MISSING
        try:
            value = pickle.loads(payload)
        except Exception as exc:  # noqa: BLE001 - an entry this code cannot read is computed again
            log.warning("result store: ignored %s (unreadable: %s): computing it again", key.digest, exc)
            self.path(key).unlink(missing_ok=True)  # type: ignore[union-attr]
            return MISSING
        with self._lock:
            self._remember(key.digest, value, len(payload))
        return value

    def _from_memory(self, digest: str) -> Any:
        entry = self._memory.get(digest)
        if entry is None:
            return MISSING
        self._memory.move_to_end(digest)
        return entry[0]

    def _remember(self, digest: str, value: object, nbytes: int) -> None:
        """Keep ``value`` in memory (under the lock), the least recently used going past ``memory_bytes``."""
        if digest in self._memory:
            self._memory_total -= self._memory.pop(digest)[1]
        self._memory[digest] = (value, nbytes)
        self._memory_total += nbytes
        while self._memory_total > self.memory_bytes and len(self._memory) > 1:
            self._memory_total -= self._memory.popitem(last=False)[1][1]

    def _read(self, key: RunKey) -> bytes | None:
        """The payload of ``key``'s entry when it is intact and really ``key``'s, else None (and it is removed)."""
        path = self.path(key)
        if path is None:
            return None
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("result store: %s unreadable (%s): computing it again", path.name, exc)
            return None
        problem = entry_problem(raw, key)
        if problem is not None:
            log.warning("result store: ignored %s (%s): computing it again", path.name, problem)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used: last to go
        except OSError:
            pass
        return raw[raw.index(b"\n", len(MAGIC)) + 1 :]

    # ------------------------------------------------------------------ writes
    def put(self, key: RunKey, value: object) -> None:
        """Keep ``value`` for ``key`` in memory and on disk (atomically), then trim the disk to its budget."""
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._remember(key.digest, value, len(payload))
        self._write(key, payload)

    def _write(self, key: RunKey, payload: bytes) -> None:
        path = self.path(key)
        if path is None:
            return
        header = json.dumps({"key": key.canonical(), "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=SUFFIX)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC + header + b"\n" + payload)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as exc:
            log.warning("result store: could not write %s (%s): kept in memory only", path.name, exc)
            return
        self.trim()

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last used, bytes, path) of every entry on disk, least recently used first."""
        if self.directory is None:
            return []
        found = []
        for path in self.directory.glob(f"*/*{SUFFIX}"):
            if path.name.startswith("."):
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:  # removed meanwhile
                continue
            found.append((stat.st_mtime, stat.st_size, path))
        return sorted(found)

    def trim(self) -> None:
        """Remove the least recently used entries while the folder holds more than ``max_bytes``."""
        with self._disk_lock:
            found = self.entries()
            total = sum(size for _, size, _ in found)
            for _, size, path in found:
                if total <= self.max_bytes:
                    break
                path.unlink(missing_ok=True)
                total -= size

    # ------------------------------------------------------------------ serving
    def serve(
        self, key: RunKey, make: Callable[[], Any], on_share: Callable[[], None] | None = None
    ) -> tuple[Any, Served]:
        """(``key``'s value, how it was served): stored, else computed by ``make()`` once and kept.

        A request for a key already being computed waits for that computation
        (``on_share()`` is called first) and gets its value, or its error. A
        computation stopped by its own request (kvlab.cancellation.Cancelled) is not
        shared: a waiter computes the value itself (kvlab.memo.compute_once).
        """
        found = self.get(key)
        if found is not MISSING:
            self.counts["stored"] += 1
            return found, "stored"
        digest = key.digest
        how: Served = "stored"

        def follow() -> None:
            nonlocal how
            how = "shared"
            if on_share is not None:
                on_share()

        payload: list[bytes] = []

        def made() -> Any:
            nonlocal how
            how = "computed"
            value = make()
            payload.append(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
            return value

        def keep(value: object) -> None:
            self._remember(digest, value, len(payload[0]))

        value = compute_once(self._lock, self._flights, digest, lambda: self._from_memory(digest), made, keep, follow)
        if how == "computed":
            self._write(key, payload[0])  # after the flight is resolved: waiters need not wait for the disk
        self.counts[how] += 1
        return value, how


_store: ResultStore | None = None
_store_lock = threading.Lock()


def store() -> ResultStore:
    """This process's result store, opened on first use where kvlab.limits.store_dir says."""
    global _store
    with _store_lock:
        if _store is None:
            _store = ResultStore(limits.store_dir(), limits.LIMITS.store_bytes)
            if _store.directory is not None:
                log.info("result store: %s (%d entries)", _store.directory, len(_store.entries()))
        return _store


def entry_problem(raw: bytes, key: RunKey) -> str | None:
    """Why ``raw`` is not an intact entry of ``key`` (None: it is)."""
    if not raw.startswith(MAGIC):
        return "not a kvlab result of this format"
    end = raw.find(b"\n", len(MAGIC))
    if end < 0:
        return "no header"
    try:
        header = json.loads(raw[len(MAGIC) : end])
    except ValueError:
        return "a damaged header"
    if not isinstance(header, dict) or header.get("key") != key.canonical():
        return "another configuration's entry"
    if hashlib.sha256(raw[end + 1 :]).hexdigest() != header.get("sha256"):
        return "a damaged payload"
    return None
