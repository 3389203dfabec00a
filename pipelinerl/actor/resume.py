"""Where a restarted actor resumes: its next prompt number, the stream's sample count, the groups it lost.

Prompt number k is the actor's k-th prompt (`task.iter_train(k)`, a pure function of the seed and k) and
its group id is `<actor_id>/<k>`. Two facts, each on disk before anything depends on it:

* RUN_DIR/actors/<actor_id>.json, `{"started": N, "lost": L}`, replaced atomically (with `streams.fsync`:
  fsynced) after the actor creates group tasks and before they run (asyncio runs a task at the loop's next
  await), so no request reaches a server for a prompt number it does not cover. N: prompts started in all
  the actor's lives; L: groups lost in flight up to this life's start.
* The totals in the actor's newest published segment (streams.segments.WriterTotals): groups and rows
  published in all its lives, in the rollouts and (rl.filter_zero_variance) in the `filtered` topic. They
  are in the segment's own metadata (published with it, atomically) and the trainer's retention never
  deletes a writer's newest segment, so they survive `retention: delete`.

A restarted actor continues at prompt N. The groups it started and never published, N - published (in
flight, or finished but still in the writer's buffer, when it died), are lost: counted, logged and never
trained (they were never published). Their prompts are skipped, not sampled again: which numbers they had
is not known after a death (groups publish in completion order without a lag bound), and skipping keeps
"no prompt replayed" simple and exact: each prompt number is started at most once over all the actor's
lives, so no group id repeats and no prompt is trained twice. The cost is at most
`actor.max_groups_in_flight` prompts per death, as the count shows.

A crash between any two steps: before the state file is replaced, no task of the new prompts has run
(nothing to count, numbers not used); after it, before the requests, those prompts count as lost though
no server saw them (an over-count of at most one start burst); between a segment's publication and
anything else, the segment carries its own totals; the trainer deleting consumed segments never touches
the newest. Without `streams.fsync` a machine crash may lose the state file's last replacement; the
actor then resumes at no less than its published groups.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pipelinerl import atomic
from pipelinerl.streams import FILTERED_TOPIC, ROLLOUT_TOPIC
from pipelinerl.streams.segments import WriterTotals, list_writers, topic_dir, writer_totals

log = logging.getLogger(__name__)

ACTORS_DIR = "actors"  # RUN_DIR/actors/<actor_id>.json: each actor's prompts started and groups lost


@dataclass(frozen=True)
class Resume:
    next_prompt: int  # prompts this actor started in all its lives: the next prompt number
    stream_samples: int  # samples published by every actor: the lag throttle's count
    lost: int  # groups this actor started and never published, in all its lives
    lost_now: int  # of which lost when it last died (since its previous start)


def state_path(run_dir: str | Path, actor_id: str) -> Path:
    return Path(run_dir) / ACTORS_DIR / f"{actor_id}.json"


def resume_position(run_dir: str | Path, actor_id: str) -> Resume:
    """Where the actor `actor_id` of this run directory resumes (from the start if it never ran). A group
    written to the `filtered` topic (rl.filter_zero_variance) is published too, but not a sample to train."""
    tdir = topic_dir(run_dir, ROLLOUT_TOPIC)
    totals = {w: writer_totals(tdir / w) for w in list_writers(tdir)}
    filtered = topic_dir(run_dir, FILTERED_TOPIC) / actor_id
    published = totals.get(actor_id, WriterTotals()).groups
    published += writer_totals(filtered).groups if filtered.is_dir() else 0
    path = state_path(run_dir, actor_id)
    state = json.loads(path.read_text()) if path.exists() else {"started": 0, "lost": 0}
    started = max(state["started"], published)
    lost = started - published
    return Resume(started, sum(t.rows for t in totals.values()), lost, lost - state["lost"])


def record_started(run_dir: str | Path, actor_id: str, started: int, lost: int, fsync: bool) -> None:
    """Replace the actor's state file: `started` prompts so far, `lost` groups up to this life's start."""
    atomic.write_file(state_path(run_dir, actor_id), json.dumps({"started": started, "lost": lost}) + "\n",
                      fsync=fsync)
