"""What `fb.from_hf` did with a checkpoint: the files it read and the config keys it read as
nothing, attached to the loaded model (`fb.load_report(model)`).

A config key that a family's transformers code never reads changes nothing there, so it is
ignored here too; published configs carry many (bert-base-uncased's `gradient_checkpointing`,
DistilBERT's `tie_weights_`). The report lists each with the reason, so that what a load
passed over is one call away instead of a guess.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .family import unexpected
from .hf_config import ConfigRead

log = logging.getLogger("flax_blocks")


@dataclass(frozen=True)
class LoadReport:
    """model_type and part of the load; source: the folder, Hub id or model class read;
    folder: the folder its files were read from (a Hub id's in the cache; None for a model
    object); files: the weight files read, in from_pretrained's choice; ignored: (config key,
    why it changes nothing) pairs, rope parameters as "rope_scaling.key"; notes: anything else
    the load decided (a stored head kept under tied embeddings, ...); config_json: the config
    read, as JSON (`config`), which `fb.save_hf` writes back."""

    model_type: str
    part: str
    source: str
    folder: str | None = None
    files: tuple[str, ...] = ()
    ignored: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    config_json: str = "{}"

    @property
    def config(self) -> dict[str, Any]:
        """The config.json read (a dict)."""
        return json.loads(self.config_json)

    @property
    def ignored_keys(self) -> dict[str, str]:
        """{config key: why it changes nothing}."""
        return dict(self.ignored)

    def __str__(self) -> str:
        lines = [f"{self.model_type} as part={self.part!r} from {self.source}"]
        lines += [f"  read {f}" for f in self.files]
        lines += [f"  ignored {k}: {why}" for k, why in self.ignored]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def make_report(config: Mapping[str, Any], part: str, origin: Mapping[str, Any], ignored: Mapping[str, str],
                notes: tuple[str, ...] = ()) -> LoadReport:
    """A LoadReport of a config read for `part` from `origin` ({"source": ..., "files": [...]})."""
    return LoadReport(str(config.get("model_type")), part, str(origin.get("source", "?")), origin.get("folder"),
                      tuple(origin.get("files", ())), tuple(sorted(ignored.items())), notes,
                      json.dumps(config, sort_keys=True))


def load_report(model: Any) -> LoadReport:
    """The LoadReport of a model `fb.from_hf` loaded (its `load_report` attribute)."""
    report = getattr(model, "load_report", None)
    if not isinstance(report, LoadReport):
        raise ValueError(f"this {type(model).__name__} was not loaded by fb.from_hf: it has no load report")
    return report


def report_ignored(model: Any, config: Mapping[str, Any], part: str, origin: Mapping[str, Any], read: ConfigRead,
                   notes: tuple[str, ...] = ()) -> None:
    """Attach the load report to `model`; warn once about the config keys that transformers'
    code for the family never reads (the known inert ones are listed without a warning), and
    about each note (the source's own, a multimodal model's unread parts, come first)."""
    notes = (*origin.get("notes", ()), *notes)
    model.load_report = make_report(config, part, origin, read.ignored, notes)
    for note in notes:
        log.warning("from_hf: %s", note)
    surprising = unexpected(read.ignored, read.family)
    if surprising:
        log.warning("from_hf: %s never reads %s: ignored, as transformers ignores %s (fb.load_report(model) lists "
                    "them)", read.family.model_class, ", ".join(surprising), "it" if len(surprising) == 1 else "them")
