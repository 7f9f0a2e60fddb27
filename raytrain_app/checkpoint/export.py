"""A checkpoint's Hugging Face model written in the Hugging Face layout: ``raytrain export``.

``save_pretrained`` writes ``config.json`` and the weights as safetensors (and, for a model
that generates, ``generation_config.json``), so ``AutoModelForCausalLM.from_pretrained``
(or the model's own class) reads the folder without raytrain. The model is rebuilt as
``load_model`` rebuilds it, under the same trust rules: the factory the checkpoint's
``meta.json`` names is called only if it is built in, named by the caller's config, or
``trust_code``; the weights are read as data (``weights_only``). Nothing from the run
directory is imported, and ``transformers`` is imported only by the factory that builds
such a model.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import sys
from pathlib import Path

from torch import nn

from raytrain_app.checkpoint.loading import load_model_spec
from raytrain_app.checkpoint.trust import CodeTrust
from raytrain_app.config import RaytrainConfig
from raytrain_app.errors import BadInputError
from raytrain_app.storage import is_uri

logger = logging.getLogger(__name__)


def check_export_folder(output: str | Path) -> Path:
    """``--output`` as a new local folder (absent or empty) in a folder that exists.

    Checked before the model is loaded: an export never overwrites or joins earlier files.
    """
    if is_uri(output):
        raise BadInputError(
            f"--output '{output}' is a URI; export writes a local folder: export here, then "
            f"upload the folder"
        )
    folder = Path(output).expanduser()
    if folder.exists() and not folder.is_dir():
        raise BadInputError(f"--output '{output}' is a file; name a new folder")
    if folder.is_dir() and any(folder.iterdir()):
        raise BadInputError(
            f"--output '{output}' is a folder that is not empty; name a new folder, so "
            f"nothing in it is overwritten"
        )
    if not folder.parent.is_dir():
        raise BadInputError(
            f"--output '{output}': the folder '{folder.parent}' does not exist; create it "
            f"or export elsewhere"
        )
    return folder


def is_hugging_face_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel``; never imports
    ``transformers`` (a model of it was built only if its factory imported it)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def export_hf(
    checkpoint: str | Path,
    output: str | Path,
    weights: str = "auto",
    *,
    trust_code: bool = False,
    config: RaytrainConfig | dict | str | Path | None = None,
) -> Path:
    """Write the Hugging Face model of ``checkpoint`` to the new folder ``output`` with
    ``save_pretrained``; returns the folder.

    Args:
        checkpoint: a checkpoint directory, or a run directory (its best checkpoint by
            train.monitor); a local path or a URI, as for ``load_model``.
        output: a local folder that does not exist yet (or is empty).
        weights: ``"ema"``, ``"raw"`` or ``"auto"``, as for ``load_model``.
        trust_code, config: which model factory the checkpoint names may be called, as
            for ``load_model``.

    Raises:
        BadInputError: the folder is taken, the factory is not trusted, or the model is
            not a Hugging Face ``PreTrainedModel``.
    """
    folder = check_export_folder(output)
    loaded = load_model_spec(checkpoint, weights, CodeTrust.from_config(config, trust_code))
    module = loaded.spec.module
    if not is_hugging_face_model(module):
        raise BadInputError(
            f"the checkpoint of '{loaded.meta_file}' holds a {type(module).__name__}, not a "
            f"Hugging Face transformers model (PreTrainedModel), and export writes only their "
            f"layout; load this one with raytrain_app.load_model"
        )
    # Written beside the target and renamed into place: a failed export leaves nothing.
    # mkdir, not mkdtemp (0700): the folder gets the umask's mode, as the files in it do.
    scratch = folder.parent / f".{folder.name}-{secrets.token_hex(6)}"
    scratch.mkdir()
    try:
        module.save_pretrained(scratch)
        os.replace(scratch, folder)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    logger.info("exported %s from %s", type(module).__name__, loaded.meta_file)
    return folder
