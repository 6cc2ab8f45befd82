"""The evaluator: the held-out loss (nats/char) of the live global model, pulled as an
observer (worker/global_model.py ``pull_into``) and reported to the server
(``ReportEval``); a failed report is logged and dropped (docs/operations.md "Held-out loss").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from asyncdiloco.errors import AsyncDiLoCoError, NotInitializedError, ServerUnavailableError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.job.models import evaluate
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.global_model import pull_into
from asyncdiloco.worker.sharded import ShardedClient

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One held-out evaluation of the global model."""

    #: The global version evaluated.
    version: int
    #: Mean held-out loss, nats per character.
    loss: float
    #: Characters (tokens) the loss is measured over.
    num_tokens: int
    #: The server took the report.
    reported: bool


class Evaluator:
    """Held-out loss of the global model of the server ``client`` talks to.

    Args:
        client: a client of the server; the evaluator pulls and reports through it (the
            caller closes it). A ``ShardedClient``: θ is assembled from every shard at one
            version (each shard's part checked against its share of the shard map), the
            status and the reports are shard 0's (it sequences every push).
        job: the default job's model shape and evaluation batches; must be the job the
            workers train (its model's manifest is checked against the server's).
        name: the evaluator's name in the server's status and dashboard.
    """

    def __init__(
        self, client: ParameterServerClient | ShardedClient, job: JobConfig | None = None, name: str = ""
    ) -> None:
        job = job if job is not None else JobConfig()
        corpus = CharCorpus.default()
        self.client = client
        self.name = name
        self.model = job.build(corpus)  # the seed's model: the server's version 0
        self.manifest = Manifest.from_module(self.model)
        self.batches = job.eval_set(corpus)  # [(x, y)], each (B, T) int64
        #: Characters each evaluation's loss is the mean over.
        self.num_tokens = sum(y.numel() for _, y in self.batches)

    def held_out_loss(self) -> float:
        """The held-out loss of the model as it is now (before any pull: the seed's), nats/char."""
        return evaluate(self.model, self.batches)

    def evaluate_global(self, report: bool = True) -> Evaluation:
        """Pull the newest global model, measure its held-out loss and (``report``) report it.

        Raises:
            NotInitializedError: the server has no global model yet. ManifestMismatchError:
            the job's model is not the server's. ServerUnavailableError: no connection.
        """
        version = pull_into(self.client, self.model, self.manifest)
        loss = self.held_out_loss()
        reported = self._report(version, loss) if report else False
        return Evaluation(version=version, loss=loss, num_tokens=self.num_tokens, reported=reported)

    def _report(self, version: int, loss: float) -> bool:
        try:
            self.client.report_eval(version, loss, self.num_tokens, self.name)
            return True
        except AsyncDiLoCoError as exc:
            log.warning("the report of version %d's loss was not taken (%s); evaluating on", version, exc)
            return False


def evaluate_every(
    evaluator: Evaluator,
    every_s: float,
    on_result: Callable[[Evaluation], None],
    *,
    max_evals: int | None = None,
    wait: Callable[[float], object],
) -> int:
    """Evaluate the global model, then again ``every_s`` (> 0) seconds after each attempt,
    skipping a version already evaluated and calling ``on_result`` with each evaluation,
    until ``max_evals`` evaluations (None: no end) or until ``wait(seconds)`` (it sleeps,
    as ``threading.Event.wait``) returns true. A server with no model yet, or one that
    cannot be reached (restarting), is asked again at the next attempt; a manifest
    mismatch ends the loop with its error. Returns the number of evaluations made.
    """
    done, last = 0, None
    while max_evals is None or done < max_evals:
        try:
            status = evaluator.client.status()
            if status.initialized and status.version != last:
                result = evaluator.evaluate_global()
                last, done = result.version, done + 1
                on_result(result)
            elif not status.initialized:
                log.info("the server has no global model yet; asking again in %g s", every_s)
        except (NotInitializedError, ServerUnavailableError) as exc:
            log.warning("no evaluation this time (%s); trying again in %g s", exc, every_s)
        if (max_evals is None or done < max_evals) and wait(every_s):
            break
    return done
