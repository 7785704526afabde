"""Split placement's generating ranks (AsyncGRPOTrainer, `async_placement="split"`): vLLM only, no DeepSpeed
engine, no trainer loop. The rank's rollout worker samples in the background while this small loop follows the
training ranks round by round: the batch cut, the new weights, and what comes after the round (a checkpoint,
the end of the run, a preemption)."""

from __future__ import annotations

from typing import Optional, Tuple

from .. import dist
from ..timing import phase
from .async_source import GroupExchange
from .sources import RolloutSetup
from .weight_stream import received_weights


class GeneratingRank:
    def __init__(self, setup: RolloutSetup):
        self.setup = setup
        self.generator = setup.generator
        self.exchange = GroupExchange(setup)

    @property
    def worker(self):
        return self.exchange.worker

    def run(self, resumed: Optional[Tuple[dict, int]] = None, initial_weights: bool = False) -> bool:
        """Until the trainers stop. `resumed`: (this rank's saved state, the round to continue from);
        `initial_weights`: the trainers send weights before the first round even when not resuming (a quantised
        policy's, which the checkpoint vLLM loaded is not). Returns True when the trainers stopped for a preemption
        (the caller exits as they do)."""
        rnd = 0
        if resumed is not None:
            state, rnd = resumed
            self.exchange.load_state_dict(state)
            self.receive_weights(rnd)  # the trainers send the resumed weights before the first round
        elif initial_weights:
            self.receive_weights(0)
        self.exchange.start_worker(rnd)
        try:
            while True:
                with phase("batch cut"):  # what the heartbeat reports of this rank's main thread
                    self.exchange.cut(rnd)
                with phase("sync"):
                    self.receive_weights(rnd + 1)
                order = dist.broadcast_object(None, src=0, group=dist.EVERYONE)  # AsyncRolloutSource.end_round
                if order["save"]:
                    with self.exchange.paused(), phase("checkpoint"):
                        dist.all_gather_object(self.exchange.state_dict(), group=dist.EVERYONE)
                        dist.barrier("the generators' pools are taken; they may sample again", group=dist.EVERYONE)
                rnd += 1
                if order["preempted"] or order["stop"]:
                    return bool(order["preempted"])
        finally:
            self.exchange.close()

    def receive_weights(self, version: int) -> None:
        """The weights training rank 0 broadcasts after an update (nothing after the last round)."""
        if dist.broadcast_object(None, src=0, group=dist.WEIGHTS):
            with self.exchange.paused():
                self.generator.load_weights(received_weights(dist.GroupChannel(dist.WEIGHTS), src=0))
                self.worker.version = version
