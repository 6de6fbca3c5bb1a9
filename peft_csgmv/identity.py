"""What makes a result of ``peft-csgmv generate`` the same as the one a run would make: the request it answers and the
settings it was made with.

The request of an input line is its prompt and its adapter, nothing else: :func:`request_sha1` hashes them (the
adapter's three spellings of the base model are one), so whitespace, key order, an ``id`` or other fields of the line,
and where the line sits in the file do not change it. Each result record carries it as ``input_sha1``.

The run settings (:class:`RunSettings`) are what the user chooses about the model and the decoding, every flag that
changes the tokens by design:

* ``base``: the base model, as its path (a local folder's real path, or the hub id). Its weights are not hashed
  (gigabytes each run); a different model under the same path is not noticed.
* ``dtype`` and ``adapter_dtype``: the precision the model and the adapters compute in (as the flags give them: ``auto``
  is not resolved to the checkpoint's dtype).
* ``max_new_tokens`` and ``do_sample``; with sampling also ``temperature``, ``top_p``, ``top_k`` and ``seed`` (greedy
  decoding reads none of them, so they are left out of a greedy run's settings).
* each adapter, by the SHA-1 of its files' bytes (``adapter_config.json`` and the weights file PEFT loads:
  ``adapter_model.safetensors``, else ``adapter_model.bin``). Its path is kept to name it in messages, but is not part
  of its identity: the same bytes elsewhere give the same tokens, other bytes at the same path do not.

Not identity, because they decide how and where the work runs, not what it computes (at most the rounding of a
floating-point sum differs): the batching (continuous batching, or ``--static-batches``), ``--batch-size``,
``--max-batch-tokens``, ``--num-blocks``, ``--cache-memory``, ``--cache-implementation``, ``--max-resident-adapters``,
``--device``, ``--device-map``, ``--backend``, the number of processes, ``--no-progress``, ``--on-error``, and
``--prompt-key`` / ``--adapter-key`` (they choose where the request is read from; the request itself is in
``input_sha1``). With sampling, the seed fixes the random stream of one run; the batching, the batch size, the process
count and a resume change which draw a row gets, so sampled completions are reproducible per run, not per line.

The batching in particular: greedy completions are the same under continuous batching and static batches (in fp32;
in half precision rounding can part near ties, as another batch size can), so it is left out of the settings. With
sampling the two draw a row's tokens in another order from the seed's stream, but from the same distribution:
the command runs continuous batching only where it honours every setting (temperature, top-p, top-k, the model's
generation config; otherwise it takes static batches by itself), so a sampled output resumed in the other mode holds
draws of the same settings, as one resumed with another batch size does. It is left out there too: an output begun
one way can be finished the other.

Each completion record carries ``settings_sha1``, :meth:`RunSettings.fingerprint` of the settings that concern it: the
run's fields and its own adapter (none for a base row). An adapter added to a later run therefore concerns no earlier
record, and a record can be checked against a run by itself. Beside the output, ``OUTPUT.settings.json``
(:func:`settings_path`) holds the settings of the run that last wrote it, readable, so that a refused rerun can say
which setting differs. It is a file of its own, not a header record in the output, so that the output stays one
result record per input line (``wc -l``, ``pandas.read_json(lines=True)``, joins on ``line`` or ``id`` keep working)
and the part files of a data-parallel run need no header of their own. The records' ``settings_sha1`` decide; the
settings file only explains: a missing or damaged one never refuses a run whose records match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

BASE = "__base__"
FORMAT = "peft-csgmv generate settings 1"
# Identity fields, in the order messages name them.
FIELDS = ("base", "dtype", "adapter_dtype", "max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "seed")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's order


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def request_sha1(prompt: str, adapter: str | None, max_new_tokens: int | None = None) -> str:
    """SHA-1 (hex) of a request: its prompt as given, its adapter (``None`` and ``"__base__"``: the base model) and,
    where its line gives one, its own ``max_new_tokens`` (a line without one keeps the fingerprint it always had)."""
    request = {"adapter": None if adapter == BASE else adapter, "prompt": prompt}
    if max_new_tokens is not None:
        request["max_new_tokens"] = max_new_tokens
    return hashlib.sha1(_canonical(request)).hexdigest()


class SettingsError(ValueError):
    """An adapter's files could not be read to fingerprint them (the message names the adapter)."""


def _adapter_files(path: str) -> list[str]:
    """The files that make an adapter what it is: its config and the weights file PEFT loads. A value that is no local
    folder is a hub id: the files come from the hub cache, fetched as PEFT would fetch them."""
    if os.path.isdir(path):
        weights = [os.path.join(path, n) for n in WEIGHT_FILES if os.path.isfile(os.path.join(path, n))]
        return [os.path.join(path, "adapter_config.json")] + weights[:1]
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError

    files = [hf_hub_download(path, "adapter_config.json")]
    for name in WEIGHT_FILES:
        try:
            return files + [hf_hub_download(path, name)]
        except EntryNotFoundError:
            continue
    return files


def adapter_sha1(path: str) -> str:
    """SHA-1 (hex) over an adapter's files (see :func:`_adapter_files`): each file's name and bytes, read in 1 MiB
    blocks, nothing cached across runs."""
    digest = hashlib.sha1()
    for file in _adapter_files(path):
        digest.update(os.path.basename(file).encode("utf-8") + b"\0")
        with open(file, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def _where(path: str) -> str:
    """A local folder's real path (the same folder named from another directory or through a link is the same); a hub
    id as given."""
    return os.path.realpath(path) if os.path.exists(path) else path


@dataclasses.dataclass
class RunSettings:
    """The identity of a run (see the module docstring): ``fields`` (base, dtypes, decoding) and ``adapters``, each
    name mapped to ``{"path": ..., "sha1": ...}``."""

    fields: dict[str, Any]
    adapters: dict[str, dict[str, str]]
    _fingerprints: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def fingerprint(self, adapter: str | None) -> str:
        """``settings_sha1`` of a record of ``adapter`` (``None``: the base model): the fields and that adapter's
        files' SHA-1."""
        if adapter not in self._fingerprints:
            own = None if adapter is None or adapter == BASE else self.adapters[adapter]["sha1"]
            self._fingerprints[adapter] = hashlib.sha1(_canonical({"adapter": own, "fields": self.fields})).hexdigest()
        return self._fingerprints[adapter]

    def concerns(self, adapter: Any) -> bool:
        """Whether records of ``adapter`` can be checked against these settings (the base model's, or a loaded
        adapter's)."""
        return adapter is None or adapter == BASE or (isinstance(adapter, str) and adapter in self.adapters)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "settings": self.fields, "adapters": self.adapters}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunSettings | None:
        """The settings a settings file holds, or ``None`` when it holds none readable."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return None
        fields, adapters = data.get("settings"), data.get("adapters")
        if not isinstance(fields, dict) or not isinstance(adapters, dict):
            return None
        if not all(isinstance(a, dict) and isinstance(a.get("sha1"), str) for a in adapters.values()):
            return None
        return cls(fields, adapters)

    def differences(self, run: RunSettings, adapters) -> tuple[list[str], list[str]]:
        """What differs from ``run`` (these settings first, ``run``'s second), as ``name=value`` items: the fields, then
        each of ``adapters`` that both hold with other files. A field one side lacks (sampling options of a greedy
        run) is named only where nothing else differs."""

        def show(key, value):
            return f"{key}={value if isinstance(value, str) else json.dumps(value)}"

        keys = [k for k in FIELDS if k in self.fields or k in run.fields]
        keys += sorted((set(self.fields) | set(run.fields)) - set(keys))
        missing = object()
        changed = [k for k in keys if self.fields.get(k, missing) != run.fields.get(k, missing)]
        both = [k for k in changed if k in self.fields and k in run.fields]
        ours = [show(k, self.fields[k]) for k in (both or changed) if k in self.fields]
        theirs = [show(k, run.fields[k]) for k in (both or changed) if k in run.fields]
        for name in sorted(a for a in adapters if a in self.adapters and a in run.adapters):
            mine, other = self.adapters[name], run.adapters[name]
            if mine["sha1"] != other["sha1"]:
                ours.append(f"adapter {name}={mine.get('path')} (files sha1 {mine['sha1'][:12]})")
                theirs.append(f"adapter {name}={other.get('path')} (files sha1 {other['sha1'][:12]})")
        return ours, theirs


def run_settings(
    base: str,
    adapters: dict[str, str],
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 50,
    seed: int = 0,
    dtype: str = "auto",
    adapter_dtype: str = "fp32",
) -> RunSettings:
    """The settings of a run (see the module docstring). Reads every adapter's files once; raises
    :class:`SettingsError` naming the adapter whose files cannot be read."""
    fields: dict[str, Any] = dict(base=_where(base), dtype=dtype, adapter_dtype=adapter_dtype,
                                  max_new_tokens=int(max_new_tokens), do_sample=bool(do_sample))  # fmt: skip
    if do_sample:
        fields.update(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=int(seed))
    identities = {}
    for name, path in adapters.items():
        try:
            sha1 = adapter_sha1(path)
        except Exception as e:  # noqa: BLE001 - any failure to read an adapter is one line naming it
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            raise SettingsError(f"--adapter {name}={path}: its files could not be read ({type(e).__name__}: {reason})")
        identities[name] = {"path": _where(path), "sha1": sha1}
    return RunSettings(fields, identities)


def settings_path(out_path: str) -> str:
    """The settings file beside an output."""
    return f"{out_path}.settings.json"


def read_settings(out_path: str) -> RunSettings | None:
    """The settings stored beside an output, or ``None`` (no file, or none readable)."""
    try:
        with open(settings_path(out_path), encoding="utf-8") as f:
            return RunSettings.from_json(f.read())
    except (OSError, UnicodeDecodeError):
        return None


def write_settings(out_path: str, settings: RunSettings) -> None:
    """Store ``settings`` beside the output (a temporary file, then a rename), unless it holds them already."""
    path, text = settings_path(out_path), settings.to_json()
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except (OSError, UnicodeDecodeError):
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
