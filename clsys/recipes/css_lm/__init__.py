"""CSS-LM (Su et al., 2021; docs/training/objectives.md#css-lm): few-shot classification that retrieves from an unlabeled corpus.

The recipe's home (``clsys.recipes.home``), everything of its own in one place:

- ``config.py``: its config (``CSSLMConfig``), with the task and the corpus as its groups ``objective.task`` and
  ``objective.corpus``;
- ``objective.py``: the model (encoder, task head, pair scorers) and both stages' losses (``CSSLM``);
- ``pair_heads.py``: the pairwise "same class / same domain" losses and scores;
- ``bank.py``: the retrieval bank (encoded corpus sentences), scoring and distributed top-k;
- ``corpus.py``: the unlabeled corpus (``objective.corpus.url``: ``data_prep wiki`` sentence shards);
- ``pipeline.py``: stages A, B and C of one seed inside Ray Train workers, and the classifier's export;
- ``driver.py``: ``python -m clsys.pretrain --config css_lm [--repeats N]``, seeds averaged;
- ``classifier.py``: the exported classifier, as ``python -m clsys.classify`` loads it.
"""
from __future__ import annotations

from typing import Any

from clsys.config import Config
from clsys.recipes.css_lm.objective import CSSLM
from clsys.recipes.home import RecipeHome


def _drive(cfg: Config, repeats: int) -> int:
    from clsys.recipes.css_lm.driver import run  # Ray and the engine: imported when the recipe runs

    return run(cfg, repeats)


def _load_classifier(folder: str) -> Any:
    from clsys.recipes.css_lm.classifier import Classifier

    return Classifier(folder)


HOME = RecipeHome(objective=CSSLM, drive=_drive, runs_seeds=True, load_classifier=_load_classifier)
