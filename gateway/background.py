"""The gateway's background loops, supervised (shared/supervision.py): the reply reader and the
model table's refresh. While either is down after a failure the gateway is not ready, and the
requests waiting on replies when the reader failed get a 503 (gRPC UNAVAILABLE) at once rather
than their timeout."""

from __future__ import annotations

from sluice.gateway.dispatcher import Dispatcher
from sluice.gateway.model_table import ModelTable
from sluice.shared.errors import Unavailable
from sluice.shared.supervision import Supervisor


def start_background(dispatcher: Dispatcher, table: ModelTable, supervisor: Supervisor) -> None:
    replies = dispatcher.replies

    def fail_waiting(exc: Exception) -> None:
        replies.fail_waiting(
            Unavailable(
                f"no answer: the gateway's reply reader failed ({type(exc).__name__}: {exc}) "
                "and is restarting; retry"
            )
        )

    supervisor.start("replies", replies.run, fail_waiting)
    supervisor.start("model-table", table.run)
