"""Every test sees the zoo registered, as a recipe with the default ``model.plugins`` does; the
recipe tests of the tiny VLM share one small VQA build (``vqa_build``)."""

from pathlib import Path

import pytest

from tests.omni_utils import build_vqa
from veomni.contract import load_plugins

load_plugins()


@pytest.fixture(scope="session")
def vqa_build(tmp_path_factory) -> Path:
    """A VQA build of 400 training and 40 held-out samples (``data/build_vqa.py``): ``train/``, ``eval/``."""
    folder = tmp_path_factory.mktemp("vqa")
    build_vqa(folder, 400, 40)
    return folder
