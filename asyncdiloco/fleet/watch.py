"""The driver's watch over a fleet's server (as an observer with the fleet's token): its
status, the held-out loss curve and the progress lines, and at the end the demo's
``Outcome`` the report is written from (docs/operations.md "A fleet on Ray").
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import time

from asyncdiloco.bench.demo import Outcome
from asyncdiloco.errors import AsyncDiLoCoError
from asyncdiloco.fleet.actors import write_token_file
from asyncdiloco.fleet.report import FleetWorker
from asyncdiloco.fleet.spec import FleetSpec
from asyncdiloco.tools.evaluator import Evaluator
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.security import ClientSecurityConfig
from asyncdiloco.worker.client import ParameterServerClient

log = logging.getLogger(__name__)

#: Seconds between two status polls.
POLL_S = 0.5


class Watch:
    """What the driver (fleet ``run_id``, its report in ``out``) keeps between polls of the
    server at ``address``."""

    def __init__(self, spec: FleetSpec, token: str, address: str, run_id: str, out: pathlib.Path) -> None:
        self.spec, self.address, self.run_id, self.out = spec, address, run_id, out
        self._token_path = write_token_file(token)
        security = ClientSecurityConfig(
            token_file=self._token_path, insecure_trusted_network=self.spec.insecure_trusted_network
        )
        client = ParameterServerClient(address, security=security)
        self.evaluator = Evaluator(client, self.spec.job, name="fleet")
        self.started = time.monotonic()
        self.initial_loss = self.evaluator.held_out_loss()  # the seed's model = the server's version 0
        self.loss = self.initial_loss
        self.curve = [{"wall_s": 0.0, "version": 0, "tokens": 0, "eval_loss": self.initial_loss}]
        self.training_since: float | None = None
        self.training_since_unix: float | None = None
        self.run_config: pb.RunConfig | None = None
        self.last_poll = self.last_eval = self.last_line = 0.0

    def poll(self, workers: list[FleetWorker]) -> pb.StatusReply | None:
        """The server's status, at most every ``POLL_S`` (None between polls or when the
        call failed); an evaluation and a progress line (about ``workers``) when due."""
        now = time.monotonic()
        if now - self.last_poll < POLL_S:
            return None
        self.last_poll = now
        try:
            st = self.evaluator.client.status()
            if st.initialized and self.training_since is None:
                self.training_since, self.training_since_unix = now, time.time()
                self.last_eval = now
            if sum(w.alive for w in st.workers) >= self.spec.num_workers:  # the auto values need every rate
                self.run_config = st.run_config
            if st.initialized and now - self.last_eval >= self.spec.eval_every_s:
                self._evaluate(st)
        except AsyncDiLoCoError as exc:
            log.info("status/eval skipped: %s", exc)
            return None
        if now - self.last_line >= self.spec.progress_every_s:
            self.last_line = now
            log.info("%s", self._line(st, workers))
        return st

    def _evaluate(self, st: pb.StatusReply) -> None:
        result = self.evaluator.evaluate_global()
        self.loss, self.last_eval = result.loss, time.monotonic()
        point = {"wall_s": self.last_eval - self.started, "version": result.version, "tokens": st.tokens}
        self.curve.append({**point, "eval_loss": self.loss})

    def _line(self, st: pb.StatusReply, workers: list[FleetWorker]) -> str:
        running = sum(w.state == "running" for w in workers)
        restarts, failed = sum(w.restarts for w in workers), sum(w.state == "failed" for w in workers)
        alive = sum(w.alive for w in st.workers)
        return (
            f"fleet {self.run_id}: {time.monotonic() - self.started:.0f} s, version {st.version}, "
            f"{st.applied_pushes} pushes applied, workers {alive} live / {running} running / {len(workers)} "
            f"(restarts {restarts}, failed {failed}), held-out loss {self.loss:.3f}"
        )

    def outcome(self, workers: list[FleetWorker]) -> Outcome:
        """The final status and evaluation, as the demo's report reads them.

        Raises:
            AsyncDiLoCoError: no worker initialized the global model.
        """
        client = self.evaluator.client
        status = client.status()
        if not status.initialized:
            raise AsyncDiLoCoError(f"no worker initialized the global model; see {self.out}/worker-*.log")
        final = self.evaluator.evaluate_global()
        wall_s = time.monotonic() - self.started
        self.curve.append(
            {"wall_s": wall_s, "version": final.version, "tokens": status.tokens, "eval_loss": final.loss}
        )
        if self.run_config is not None:
            status.run_config.CopyFrom(self.run_config)
        since = self.training_since
        return Outcome(
            address=self.address,
            status=status,
            curve=self.curve,
            initial_loss=self.initial_loss,
            final_loss=final.loss,
            wall_s=wall_s,
            workers=workers,
            exit_codes=[w.exit_code for w in workers],
            train_start_s=(since - self.started) if since is not None else 0.0,
            train_start_unix_s=self.training_since_unix,
        )

    def close(self) -> None:
        self.evaluator.client.close()
        shutil.rmtree(os.path.dirname(self._token_path), ignore_errors=True)
