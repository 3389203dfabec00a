"""The trainer's pending HTTP requests of one round phase, one per server, beside the collective (sender.py)."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_EXCEPTION, Future, wait

from pipelinerl.control import ControlError
from pipelinerl.weights.wire import WeightTransferError


class Replies:
    """The servers' pending replies to one request each (the HTTP side of a round, beside the collective)."""

    def __init__(self, futures: dict[str, Future]):
        self.futures = futures

    def raise_failed(self, within_s: float = 0.0) -> None:
        """A server that answered with an error has failed: stop waiting for it (the error names its URL).
        A reply may arrive before this side's last collective completes (a receiver can finish before its
        sender does): a success, or a rejection of the whole update by a server that kept its group
        (wire.UpdateRejected): neither stops the round, settle() collects them. `within_s`: first wait up
        to that long for some reply to fail."""
        if within_s > 0:
            wait(self.futures.values(), timeout=within_s, return_when=FIRST_EXCEPTION)
        for fut in self.futures.values():
            if fut.done() and (err := fut.exception()) is not None:
                if not (isinstance(err, ControlError) and err.body.get("group_ready")):
                    raise err

    def settle(self, deadline: float) -> tuple[dict[str, dict], dict[str, WeightTransferError]]:
        """Every server's reply or error; TimeoutError naming the first server still silent at `deadline`."""
        replies, errors = {}, {}
        for url, fut in self.futures.items():
            try:
                replies[url] = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise TimeoutError(f"timed out waiting for the reply of {url}") from None
            except ControlError as err:
                errors[url] = err
        return replies, errors

    def join(self, deadline: float) -> dict[str, dict]:
        replies, errors = self.settle(deadline)
        if errors:
            raise next(iter(errors.values()))
        return replies

    def pending(self) -> str:
        return ", ".join(url for url, fut in self.futures.items() if not fut.done()) or "the servers"

    def done(self) -> set[str]:
        return {url for url, fut in self.futures.items() if fut.done()}

    def silent_after(self, within_s: float) -> tuple[list[str], dict[str, dict | BaseException]]:
        """Wait up to `within_s` for every reply; the servers still silent, and the others' replies or errors."""
        wait(self.futures.values(), timeout=within_s)
        silent = [url for url, fut in self.futures.items() if not fut.done()]
        answered = {url: fut.exception() or fut.result() for url, fut in self.futures.items() if fut.done()}
        return silent, answered
