"""The mid-training corpus: function-synthesis documents and agent transcripts, as token segments.

A document is a list of segments ``(text, written_by_the_policy)``. Each segment is tokenized on its
own, exactly as the rollout loop does it: the environment's text (a prompt, a tool's output ending in
``$ ``) and the policy's text (an answer, a command line) never merge into one token, so the model
learns to continue a context that ends where an environment's turn ends.

* function documents: ``# f(0)=7 f(1)=15 ...\\ndef f(x): return `` + the answer (train-split
  functions only, :func:`offline_rl.tasks.corpus`);
* agent transcripts: repository episodes played by the mixed-care demonstrator
  (:mod:`offline_rl.demos`) on training tasks.

``midtrain.agent_share`` sets the mixture. Batches are built to a token budget from a pool of
documents grouped by length, so a step costs about the same whatever it holds and little is padding.

Mid-training is language modelling on whole documents, tool output included (it shows what the tools
return), with one exception (:class:`Row`): the environment's summary request gets no loss. It is
written where the agent's next command would go, and a model that learnt to predict it writes it
itself when no budget asked for a summary: "# context full" as a command, in every context as long
as the ones the demonstrations summarised.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from offline_rl.config import MidtrainSettings, TaskSettings
from offline_rl.demos import DemoHabits, Segment, transcript_text, transcripts
from offline_rl.repo_tasks import FAMILIES
from offline_rl.tasks import corpus as function_corpus
from policy.config import TinyModelSettings
from policy.summary import SUMMARY_REQUEST
from policy.tiny import build_tiny_model

ANSWER_MARK = "return "
POOL_BATCHES = 8
"""Documents for this many batches are drawn at once and grouped by length before batching."""
LENGTH_BUCKET = 128
"""Documents are grouped by ``len // LENGTH_BUCKET``, not by exact length: within a bucket they keep the
order they were drawn in. Sorting by exact length put documents of one answer shape side by side
(same length, same kind of function), and the correlated batches left a mid-trained model far below
one trained on shuffled batches (functions preset, 400 steps: held-out success 0.03-0.07 against
0.51)."""


def function_segments(doc: str) -> list[Segment]:
    """A function document split where the prompt ends (after ``return ``) and the answer begins."""
    cut = doc.rfind(ANSWER_MARK)
    if cut < 0:
        return [(doc, False)]
    cut += len(ANSWER_MARK)
    return [(doc[:cut], False), (doc[cut:], True)]


@dataclass
class Row:
    """A document as mid-training sees it: its token ids, and per token whether predicting it is trained
    (False on the environment's summary request)."""

    ids: list[int]
    trained: list[bool]

    def __len__(self) -> int:
        return len(self.ids)


def document_row(tokenizer, segments: list[Segment]) -> Row:
    """The document's tokens (as :func:`segment_ids`) with the summary request's tokens untrained."""
    ids: list[int] = []
    trained: list[bool] = []
    for text, by_policy in segments:
        part = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += part
        trained += [by_policy or text != SUMMARY_REQUEST] * len(part)
    return Row(ids, trained)


def segment_ids(tokenizer, segments: list[Segment]) -> list[int]:
    """The document's token ids, each segment tokenized on its own."""
    return document_row(tokenizer, segments).ids


def documents(n: int, seed: int, split_seed: int, heldout_fraction: float, agent_share: float,
              habits: DemoHabits | None = None, families: Sequence[str] = FAMILIES,
              rule_drill: float = 0.0) -> Iterator[list[Segment]]:
    """``n`` documents drawn with ``seed``, a share ``agent_share`` of them agent transcripts (of the
    task ``families`` in turn), the rest function documents; none touches a function held out by the
    split with ``split_seed``."""
    rng = random.Random(seed + 70_001)
    fdocs = function_corpus(n, seed=seed, heldout_fraction=heldout_fraction, split_seed=split_seed)
    tdocs = transcripts(n, seed=seed, heldout_fraction=heldout_fraction, habits=habits, split_seed=split_seed,
                        families=families, rule_drill=rule_drill)
    for _ in range(n):
        yield next(tdocs) if rng.random() < agent_share else function_segments(next(fdocs))


def token_batches(tokenizer, docs: Iterable[list[Segment]], batch_tokens: int) -> Iterator[list[Row]]:
    """Batches of documents (:class:`Row`) whose padded size (rows x longest row) stays within ``batch_tokens``.

    Documents are drawn a pool at a time and grouped into length buckets (:data:`LENGTH_BUCKET`), so
    rows of a batch have similar lengths while documents within a bucket stay in random order; the
    batches of a pool are then shuffled so long and short ones alternate."""
    it = iter(docs)
    rng = random.Random(0)
    while True:
        pool = []
        budget = batch_tokens * POOL_BATCHES
        for segs in it:
            row = document_row(tokenizer, segs)
            pool.append(row)
            budget -= len(row)
            if budget <= 0:
                break
        if not pool:
            return
        pool.sort(key=lambda row: len(row) // LENGTH_BUCKET)  # stable: draw order within a bucket
        batches, cur, width = [], [], 0
        for row in pool:
            if cur and (len(cur) + 1) * max(len(row), width) > batch_tokens:
                batches.append(cur)
                cur, width = [], 0
            cur.append(row)
            width = max(width, len(row))
        if cur:
            batches.append(cur)
        rng.shuffle(batches)
        yield from batches


def midtrain_batches(tokenizer, cfg: MidtrainSettings, tasks: TaskSettings) -> Iterator[list[Row]]:
    """Mid-training batches: documents drawn with ``midtrain.seed``, held-out functions those of the
    task split (``tasks.seed``, ``tasks.heldout_fraction``) the model is evaluated on, transcripts of
    ``midtrain.families`` (default: the task families, ``tasks.repo_families``)."""
    habits = DemoHabits(**cfg.demo_habits) if cfg.demo_habits else None
    docs = documents(1 << 40, cfg.seed, tasks.seed, tasks.heldout_fraction, cfg.agent_share, habits,
                     families=tuple(cfg.families or tasks.repo_families), rule_drill=cfg.rule_drill)
    return token_batches(tokenizer, docs, cfg.batch_tokens)


def tokenizer_texts(n: int, seed: int, heldout_fraction: float = 0.2) -> list[str]:
    """What the tiny model's tokenizer is trained on: both kinds of documents, as plain text."""
    half = max(1, n // 2)
    texts = list(function_corpus(half, seed=seed, heldout_fraction=heldout_fraction))
    texts += [transcript_text(t) for t in transcripts(half // 2, seed=seed, heldout_fraction=heldout_fraction)]
    return texts


def build_default_model(out_dir: str | Path, cfg: TinyModelSettings | None = None, *, moe: bool = False) -> Path:
    """The tiny default model, its tokenizer trained on this corpus (see :func:`policy.tiny.build_tiny_model`;
    ``moe``: its mixture-of-experts variant)."""
    cfg = cfg or TinyModelSettings()
    return build_tiny_model(out_dir, cfg, tokenizer_texts(cfg.corpus_examples, cfg.seed), moe=moe)
