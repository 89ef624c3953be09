"""The README's quick-start figures describe the quick-start recipe as it is.

The README once promised "400 steps ... against a baseline of 5.82" long after a change to the
eval data had moved the baseline to 5.75, and a new user could not tell a stale figure from a
run that does not reproduce. The baseline (the unigram entropy of the tokens the run evaluates
on) needs no training: it is recomputed here from the recipe's own eval split, laid out as the
quick start's 2 processes read it, with the engine's own task statistics. The step count is read
from the recipe. A change to the recipe, the corpus or the eval reading that moves either fails
here until the README is measured again.
"""

import re
from pathlib import Path

import pytest

from veomni.config.load import load_config
from veomni.contract import build_config, get_model_spec, load_plugins
from veomni.data.build_loader import build_dataloader, dataset_kind_name, load_run_tokenizer
from veomni.launch import main as launch_main
from veomni.train.report.baseline import add_padded

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "quickstart" / "tiny_llm.yaml"
QUICKSTART_PROCESSES = 2  # scripts/train.sh's default on CPU, which the README's figures were measured with
FIGURES = re.compile(r"(?P<steps>\d+) steps in [^,]+ wall, ending at (?P<loss>[\d.]+) nats\s+against a baseline of "
                     r"(?P<baseline>[\d.]+)")


def _readme_figures() -> dict[str, str]:
    found = FIGURES.search((REPO / "README.md").read_text())
    assert found, "README.md's quick-start paragraph no longer states 'N steps in ... wall, ending at X nats " \
                  "against a baseline of Y': update this test's pattern with the paragraph"
    return found.groupdict()


def _eval_baseline(tmp_path: Path) -> float:
    """The baseline the quick start's final eval reports, without training: every eval batch each of
    the 2 ranks reads (``train.eval_batches: 0``, the whole held-out split, as ``Trainer._eval_batches``
    scores it), their task statistics summed."""
    overrides = ["--train.output_dir", str(tmp_path / "out")]
    assert launch_main([str(RECIPE), "--launcher-world-size", str(QUICKSTART_PROCESSES), *overrides]) == 0  # data
    cfg = load_config(str(RECIPE), overrides)
    load_plugins(cfg.model.plugins)
    spec = get_model_spec(cfg.model.arch)
    model_config = build_config(cfg.model.arch, cfg.model.options)
    task, kind = spec.task(model_config), dataset_kind_name(cfg.data, spec.dataset)
    tokenizer = load_run_tokenizer(cfg.data, kind)
    assert cfg.train.eval_batches == 0, "the quick start scores its whole held-out split; update this test"
    stats = None
    for rank in range(QUICKSTART_PROCESSES):
        for batch in build_dataloader(cfg.data, "eval", tokenizer, rank, QUICKSTART_PROCESSES, cfg.train.seed,
                                      model_config, kind):
            stats = add_padded(stats, task.baseline_stats(task.prepare(batch)))
    return task.baseline_loss(stats).loss


def test_readme_step_count_is_the_recipes():
    max_steps = load_config(str(RECIPE), []).train.max_steps
    assert int(_readme_figures()["steps"]) == max_steps
    assert f"{max_steps} steps, ends below the unigram baseline" in (REPO / "README.md").read_text()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_readme_baseline_is_the_recipes_eval_baseline(tmp_path):
    figures = _readme_figures()
    baseline = _eval_baseline(tmp_path)
    assert float(figures["baseline"]) == pytest.approx(baseline, abs=0.005), (
        f"the quick start's eval baseline is {baseline:.3f} nats, README.md says {figures['baseline']}: measure the "
        "quick start again (bash scripts/train.sh recipes/quickstart/tiny_llm.yaml on an idle machine) and update "
        "the README's steps, wall time, final eval loss, baseline and perplexities together")
    # the first thing a user runs must show plainly that the model learned: a margin that no run-to-run
    # or machine-to-machine difference (hundredths) could close
    assert float(figures["loss"]) < baseline - 0.25, "the README's quick start must end well below its baseline"
