"""Arrow rollout streams: actors write, the trainer reads, through files in the run directory.

Parallel filesystems (Lustre, GPFS, NFS) give no reliable locks, inotify or append visibility, so:

* **Publishing.** A writer (one per actor process) buffers whole groups, encodes a segment (Arrow IPC
  file, one record batch per group), writes it under a hidden temporary name, fsyncs it, and renames it
  into place as `<seq>.<crc32>.arrow`. A reader sees a whole segment or nothing; a writer killed at any
  point leaves at most a temporary file that readers never open and the writer's next incarnation
  deletes. With `streams.fsync` the folder is fsynced after the rename as well, so a segment a reader
  has consumed cannot vanish in a machine crash and be renumbered with other data.
* **Order.** Each writer's segments are read in sequence order; writers are interleaved round-robin by
  segment, in writer-id order, among the segments visible at each listing. Readers poll. A network
  filesystem's listing may show a segment late, after a later one: a segment's totals minus its own groups
  say how many of its writer's groups precede it, and while that is more than the reader has read, it
  hands out nothing of that writer (the others go on), logs a warning once and lists again at each poll.
  A sequence number that was never published is no gap: the totals run on.
* **Cursor.** Per writer, the (segment seq, group index) of the next unread group and (`groups_before`)
  how many of the writer's groups precede that segment: 0 for a writer a fresh reader has not read. A
  cursor saved without `groups_before` takes each writer's next segment as it comes. Readers hand out only
  whole groups and move the cursor as they do, so a reader rebuilt from a saved cursor neither repeats
  nor skips a group, whatever it had loaded (or held back at a gap) but not handed out when it died.
* **One reader per run.** The trainer's rank 0 reads the stream and hands each rank its exact share
  of every step (pipelinerl/trainer/step_data.py): shares that a per-rank rule computed per segment
  drifted apart across segments, and a rank short of data waited for groups that never came. Readers
  stay free of torch and process groups; one cursor describes the whole run's position.
* **Faults.** A segment whose CRC-32 or Arrow structure is wrong is renamed to `*.corrupt`, logged
  (logging.ERROR) and skipped; a gap with a `*.corrupt` file in it (or a segment this reader quarantined
  or saw vanish) is not waited for: its groups are lost, and logged. Duplicate sample ids are dropped:
  the seen-set holds the last `streams.dedup_window` ids (FIFO; ~120 bytes each, so 100k ids is ~12 MB);
  older duplicates pass. The seen-set is not part of the cursor: after a resume, duplicates of samples
  read before it pass.
* **Retention.** `release(run_dir, topic, cursor, cfg)` deletes the segments the cursor has
  passed (with `retention: delete`); call it only after the checkpoint that holds that cursor is
  written. The newest published segment of each writer stays, so a restarted writer continues its
  numbering and its totals. Before deleting, it records the cursor in the topic's `.released.json`: a
  reader whose gap lies behind that position (a fresh reader of a released stream, or a trainer resumed
  from a checkpoint older than the last release) logs a warning and reads on from it instead of waiting.
* **Totals.** Each segment's schema metadata holds its writer's groups and rows published so far, this
  segment included, over all the writer's restarts (`segments.WriterTotals`): published atomically with
  the data, they survive retention, and a restarted actor resumes from them (pipelinerl/actor/resume.py).
"""

from pipelinerl.streams.reader import StreamReader, StreamTimeout, release
from pipelinerl.streams.report import format_inspect, inspect
from pipelinerl.streams.schema import ROLLOUT_SCHEMA, SCHEMA_VERSION, Rollout
from pipelinerl.streams.segments import EVAL_TOPIC, FILTERED_TOPIC, ROLLOUT_TOPIC
from pipelinerl.streams.writer import StreamWriter

__all__ = ["EVAL_TOPIC", "FILTERED_TOPIC", "ROLLOUT_SCHEMA", "ROLLOUT_TOPIC", "SCHEMA_VERSION", "Rollout",
           "StreamReader", "StreamTimeout", "StreamWriter", "format_inspect", "inspect", "release"]
