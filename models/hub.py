"""Where a model named in a config is found: local folders, the packaged examples, the hub.

Role: the launcher resolves every model field of the actors' tables (`model`, `model_path`,
`ref_model`, `tokenizer_path`, a teacher's `model`: launch/config.py MODEL_FIELDS) once, at load,
before anything starts, so that every actor gets a name it can load without a network. In order:
1. a built-in tiny model name (models/tiny.py): kept as written;
2. a Hugging Face checkpoint directory (a folder holding config.json): an absolute path as
   written, else a path relative to the hosts file's folder, then to the working directory, then
   the packaged examples (`examples/<name>`, e.g. `model = "base-tiny"` from anywhere): made
   absolute;
3. a hub id, `org/name` or `org/name@revision` (a branch, tag or commit): fetched with
   `huggingface_hub.snapshot_download` into its cache on the launcher's host (`HF_HOME`,
   `HF_HUB_CACHE`; `HF_ENDPOINT` for a mirror; `HF_TOKEN` for gated models), with its progress
   bars on stderr; with `HF_HUB_OFFLINE=1` only the cache is read. The field becomes the
   snapshot's local folder. Weight formats the engines here never read (flax, tf, onnx, gguf,
   `original/`) are not fetched.
Anything else is kept as written, and the actor's own check (models/names.py check_model_path)
refuses it, naming these places.

Invariant: `resolve` never raises anything but HubError (a one-line message that says what to
do: fix the name, log in, or pre-download on a host with network); a hub id is fetched once per
load even when several fields name it.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from models.names import TINY_NAMES, is_checkpoint_dir
from transport.errors import RlxError

# org/name, each part letters, digits, '-', '_', '.' (the hub's own rule), then @revision
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")
NOT_FETCHED = ["*.msgpack", "*.h5", "*.onnx", "*.gguf", "*.ot", "*.tflite", "original/*",
               "onnx/*", "coreml/*", "*.mlmodel"]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


class HubError(RlxError, ValueError):
    """A model reference that is neither local nor obtainable from the hub."""


def local_candidates(value: str, base: Path) -> list[Path]:
    """The folders a relative model name is looked for in, in order."""
    return [base / value, Path.cwd() / value, EXAMPLES / value]


def hub_id(value: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `value` has the shape of a hub id, else None."""
    m = HUB_ID.match(value)
    return (m["repo"], m["rev"]) if m else None


def resolve(value: str, base: Path, fetched: dict[str, str] | None = None) -> str:
    """The reference actors get for the model field `value` of a hosts file in folder `base`
    (the module docstring's order); `fetched` caches hub ids across the fields of one load."""
    if not value or value in TINY_NAMES:
        return value
    if os.path.isabs(value):
        return value
    for folder in local_candidates(value, base):
        if is_checkpoint_dir(folder):
            return str(folder.resolve())
    parsed = hub_id(value)
    if parsed is None:
        return value  # the actor's check says where it looked (models/names.py)
    fetched = {} if fetched is None else fetched
    if value not in fetched:
        fetched[value] = fetch(*parsed, looked=local_candidates(value, base))
    return fetched[value]


def fetch(repo: str, revision: str | None, looked: list[Path] = ()) -> str:
    """The local snapshot folder of `repo` at `revision` (default branch when None), downloaded
    into the cache unless offline; HubError saying what to do otherwise."""
    from huggingface_hub import (
        constants,  # here: only a hub id pays its import
        snapshot_download,
    )
    from huggingface_hub import errors as hf_errors
    # the library's own reading of HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE and HF_ENDPOINT
    offline, cache, endpoint = constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE, constants.ENDPOINT
    name = repo + (f"@{revision}" if revision else "")
    pre = (f"pre-download it on a host with network (hf download {repo}"
           f"{f' --revision {revision}' if revision else ''}, with the same HF_HOME or copying "
           f"its cache folder here), or set the field to a local checkpoint directory")
    if not offline:
        print(f"model {name}: fetching from {endpoint} into {cache} "
              f"(HF_HUB_OFFLINE=1 reads the cache only)", file=sys.stderr, flush=True)
    try:
        path = snapshot_download(repo, revision=revision, local_files_only=offline,
                                 ignore_patterns=NOT_FETCHED)
    except hf_errors.RevisionNotFoundError:
        raise HubError(f"model {name!r}: the hub has {repo} but no revision {revision!r} "
                       f"(a branch, tag or commit); fix the part after '@'") from None
    except (hf_errors.GatedRepoError, hf_errors.RepositoryNotFoundError) as e:
        gated = isinstance(e, hf_errors.GatedRepoError)
        where = ", ".join(str(p) for p in looked)
        raise HubError(f"model {name!r}: " + (
            "a gated hub model: accept its terms on the hub and log in (hf auth login, or set "
            "HF_TOKEN)" if gated else
            f"no such hub model (nor a checkpoint directory at {where}); check the name "
            f"(private models need hf auth login or HF_TOKEN)")) from None
    except hf_errors.LocalEntryNotFoundError:
        if offline:
            raise HubError(f"model {name!r}: not in the hub cache {cache} and HF_HUB_OFFLINE is "
                           f"set; {pre}") from None
        raise HubError(f"model {name!r}: cannot reach {endpoint} and it is not in "
                       f"the cache {cache}; {pre}") from None
    except Exception as e:  # noqa: BLE001 - the network (httpx), a full disk, a bad cache
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"model {name!r}: fetching it into {cache} failed ({first}); {pre}") \
            from None
    if not is_checkpoint_dir(path):
        raise HubError(f"model {name!r}: the hub snapshot {path} has no config.json, so it is "
                       f"not a transformers checkpoint; give a model repository")
    return path
