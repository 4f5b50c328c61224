"""A learner's copy of the global model: `learners/N/global.safetensors`.

Owns the file that lets a run whose syncer's state is lost (its host gone with its disk) still give its model. Each
learner holds every fragment of the global model at the version it last received, bit for bit the syncer's value
(`ddiloco.local_fragments`: its bases). Each checkpoint (`ddiloco.learner_checkpoint`) writes them here with their
versions, the fragments' tensor names and the model's tied names; `freshest` reads every learner's file under one
directory and puts together, fragment by fragment, the newest version any of them holds: what `ddiloco export
--from-learners` writes. When to write is the checkpoint's business; a new run starts from the export (`--init`,
docs/runtime.md, "When the syncer's state is lost").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ddiloco.checkpoint import atomic_write_bytes, learner_files, remove_stale_temps
from ddiloco.learner import Learner

logger = logging.getLogger(__name__)

GLOBAL_COPY_FILE = "global.safetensors"
"""A learner's copy of the global model, in its directory of the run (`learners/N/`)."""
METADATA_KEY = "ddiloco_global_copy"
"""The safetensors metadata entry holding the copy's description (JSON)."""


@dataclass(frozen=True)
class GlobalCopy:
    """The global fragments one learner holds."""

    learner_id: int
    inner_step: int
    """The learner's inner step when it was taken."""
    fragments: tuple[tuple[str, ...], ...]
    """Every fragment's tensor names, in the run's order (the plan)."""
    versions: tuple[int, ...]
    """Per fragment, the version held; -1 for one the learner has not received (its tensors are absent)."""
    aliases: tuple[tuple[str, str], ...]
    """(second name, parameter name) of each tied parameter."""
    tensors: dict[str, torch.Tensor]
    """float32, by parameter name, for every fragment held."""


def snapshot(learner: Learner) -> GlobalCopy | None:
    """`learner`'s copy now, on the training thread, or None before it has received any fragment. The tensors are its
    bases themselves, not copies: a new version replaces a base rather than writing into it, so they stay as taken."""
    versions = tuple(learner.versions)
    if all(version < 0 for version in versions):
        return None
    tensors = {name: tensor for p, base in enumerate(learner.local.base) if versions[p] >= 0
               for name, tensor in base.items()}
    return GlobalCopy(learner.learner_id, learner.inner_step, tuple(map(tuple, learner.plan.fragments)), versions,
                      tuple(learner.aliases), tensors)


def write(directory: Path, copy: GlobalCopy | None) -> None:
    """`directory`/global.safetensors, replaced at once and durably (it is what is left of the model if the syncer's
    disk is lost). Nothing for None."""
    if copy is None:
        return
    from safetensors.torch import save

    description = {"learner_id": copy.learner_id, "inner_step": copy.inner_step,
                   "fragments": [list(names) for names in copy.fragments], "versions": list(copy.versions),
                   "aliases": [list(pair) for pair in copy.aliases]}
    tensors = {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in copy.tensors.items()}
    atomic_write_bytes(directory / GLOBAL_COPY_FILE, save(tensors, metadata={METADATA_KEY: json.dumps(description)}))
    remove_stale_temps(directory)  # a copy a killed process was writing: the model's size each


def read(path: Path) -> GlobalCopy:
    """The copy in `path`; ValueError naming the file when it is not one (unreadable, another file, incomplete)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None
    try:
        description = json.loads(metadata[METADATA_KEY])
        copy = GlobalCopy(int(description["learner_id"]), int(description["inner_step"]),
                          tuple(tuple(str(name) for name in names) for names in description["fragments"]),
                          tuple(int(version) for version in description["versions"]),
                          tuple((str(alias), str(name)) for alias, name in description["aliases"]), tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a learner's copy of the global model ({type(exc).__name__}: {exc})") from None
    if len(copy.versions) != len(copy.fragments):
        raise ValueError(f"{path} is incomplete: {len(copy.versions)} versions for {len(copy.fragments)} fragments")
    missing = [name for p, names in enumerate(copy.fragments) if copy.versions[p] >= 0 for name in names
               if name not in tensors]
    if missing:
        raise ValueError(f"{path} is incomplete: it lacks {', '.join(missing[:5])}")
    return copy


@dataclass(frozen=True)
class Recovered:
    """The global model put together from learners' copies (`freshest`)."""

    params: dict[str, torch.Tensor]
    """Every parameter, float32, tied ones under each of their names."""
    aliases: tuple[str, ...]
    """The names in `params` that are a tied parameter's second name."""
    versions: tuple[int, ...]
    """Per fragment, the version taken."""
    sources: tuple[int, ...]
    """Per fragment, the learner whose copy it was taken from (the lowest id among those holding that version)."""
    learners: tuple[int, ...]
    """Every learner whose copy was read."""


def learner_copies(directory: Path) -> list[Path]:
    """The copies under `directory`/learners/N/, by learner id."""
    return [path for _, path in learner_files(directory, GLOBAL_COPY_FILE)]


def freshest(directory: Path) -> Recovered:
    """The newest version of each fragment that any learner's copy under `directory` holds (`learners/N/global.
    safetensors`: the learners' directories of a run, gathered from their hosts). A copy that cannot be read is
    logged and left out. ValueError when there is none, when the copies are of models cut otherwise (another run),
    when two hold one fragment's version with other values (not one run either), or when no copy holds some
    fragment."""
    paths = learner_copies(directory)
    copies: list[GlobalCopy] = []
    for path in paths:
        try:
            copies.append(read(path))
        except ValueError as exc:
            logger.warning("%s: left out", exc)
    if not copies:
        found = f" ({len(paths)} found, none readable)" if paths else ""
        raise ValueError(f"{directory} holds no learner's copy of the global model{found}: each learner writes it as "
                         f"learners/N/{GLOBAL_COPY_FILE} with its checkpoints; gather the learners' directories "
                         f"(learners/0, learners/1, ...) of the run under {directory / 'learners'}")
    first = copies[0]
    for copy in copies[1:]:
        if copy.fragments != first.fragments or copy.aliases != first.aliases:
            raise ValueError(f"the copies of learners {first.learner_id} and {copy.learner_id} are of models cut "
                             "into other fragments: they are not of one run")
    versions, sources, params = [], [], {}
    for p, names in enumerate(first.fragments):
        newest = max(copy.versions[p] for copy in copies)
        if newest < 0:
            raise ValueError(f"no learner's copy holds fragment {p} ({names[0]}, ...): the learners never received it")
        holding = [copy for copy in copies if copy.versions[p] == newest]
        for other in holding[1:]:
            if not all(torch.equal(holding[0].tensors[name], other.tensors[name]) for name in names):
                raise ValueError(f"learners {holding[0].learner_id} and {other.learner_id} hold version {newest} of "
                                 f"fragment {p} with other values: their copies are not of one run")
        versions.append(newest)
        sources.append(holding[0].learner_id)
        params.update({name: holding[0].tensors[name] for name in names})
    for alias, name in first.aliases:
        params[alias] = params[name].clone()
    return Recovered(params, tuple(alias for alias, _ in first.aliases), tuple(versions), tuple(sources),
                     tuple(copy.learner_id for copy in copies))
