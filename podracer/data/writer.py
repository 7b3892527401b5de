"""Write RLDS episodes as a tensorflow-datasets dataset in the array_record format.

No TensorFlow is needed: records are `tf.train.Example` protos built by tfds's
numpy serializer and stored with array_record. The result reads back with
`tfds.builder_from_directory(data_dir)` (`as_data_source()` without TensorFlow,
`as_dataset()` with it) and with `podracer.data.load_episodes(data_dir)`.

    writer = DatasetWriter("/tmp/cartpole", step_spec_for_env(env.spec))
    writer.add_step(obs, action, reward, policy_log_prob=log_prob)
    ...
    writer.end_episode(final_obs, terminated=True)
    writer.close()

`data_dir` may be `gs://BUCKET/PATH` (`pip install 'podracer-rl[gcs]'`):
array_record writes local files only, so the writer records into a temporary
local directory and `close()` uploads it (`dataset_info.json` last, so a copy
cut short is not a dataset) and removes it. An upload that fails raises a
one-line `PodracerError` naming the local copy, which it keeps.

One writer may be shared by several actor threads: each passes its own
`stream` (any hashable, e.g. `(actor_id, env_index)`) to `add_step` and
`end_episode`, and a lock makes every call atomic. The lock is held while an
episode is serialised, so writing costs an actor that much time at episode ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Any, Hashable, Mapping

import numpy as np

from podracer.data.episodes import unpad_episodes
from podracer.data.spec import (ACTION, DISCOUNT, EPISODE_METADATA, IS_FIRST, IS_LAST, IS_TERMINAL,
                                OBSERVATION, RLDS_STEP_FIELDS, REWARD, STEPS, FieldSpec, import_tfds,
                                tfds_features)
from podracer.errors import PodracerError
from podracer import storage

DEFAULT_NAME = "podracer_episodes"
FILE_FORMAT = "array_record"


def check_new_dataset_dir(data_dir: str) -> None:
    """A one-line error unless `data_dir` (local or `gs://`) is new or an empty directory:
    never mix datasets."""
    if storage.is_remote(data_dir):
        taken = storage.exists(data_dir) and not (storage.isdir(data_dir) and not storage.listdir(data_dir))
    else:
        taken = os.path.isfile(data_dir) or (os.path.isdir(data_dir) and bool(os.listdir(data_dir)))
    if taken:
        raise PodracerError(f"{data_dir} already exists and is not empty; "
                            f"record into a new or empty directory")


def _make_dataset_dir(data_dir: str) -> None:
    check_new_dataset_dir(data_dir)
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as error:
        raise PodracerError(f"cannot create dataset directory {data_dir}: {error.strerror}") from None


class DatasetWriter:
    """Appends episodes to a new tfds array_record dataset in `data_dir`.

    Args:
      data_dir: a new or empty directory; it becomes the dataset's directory (the
        one holding `dataset_info.json`).
      steps: the step fields, e.g. `step_spec_for_env(env.spec)`; must include the
        RLDS fields (observation, action, reward, discount, is_first, is_last,
        is_terminal).
      name, version, split, description: what tfds reports about the dataset.
      metadata: JSON-serialisable dataset-level facts (env id, policy, seed),
        stored in `metadata.json` and read back as `info.metadata`.
      max_shard_bytes: a new array_record file starts when the current one passes this.

    `data_dir` may be `gs://BUCKET/PATH`: the dataset is written locally (in
    `tempfile`'s directory: `TMPDIR`) and uploaded by `close()`.

    Every episode also gets `episode_id`, `episode_return` and `episode_length`.
    Call `close()` (or use the writer as a context manager): the dataset's
    metadata is written when a shard is finished. Episodes begun with `add_step`
    but never ended are dropped at `close()`.
    """

    def __init__(self, data_dir: str, steps: Mapping[str, FieldSpec], *, name: str = DEFAULT_NAME,
                 version: str = "1.0.0", split: str = "train", description: str = "",
                 metadata: Mapping[str, Any] | None = None, max_shard_bytes: int = 256 << 20):
        tfds = import_tfds()
        from array_record.python.array_record_module import ArrayRecordWriter
        from tensorflow_datasets.core.example_serializer import ExampleSerializer

        missing = [field for field in RLDS_STEP_FIELDS if field not in steps]
        if missing:
            raise ValueError(f"step spec lacks the RLDS fields {missing}")
        self._steps = {name_: FieldSpec(tuple(spec.shape), np.dtype(spec.dtype))
                       for name_, spec in steps.items()}
        self.data_dir = data_dir
        if storage.is_remote(data_dir):  # array_record writes local files: record here, upload at close
            check_new_dataset_dir(data_dir)
            self._local_dir: str | None = tempfile.mkdtemp(prefix="podracer-dataset-")
            data_dir = self._local_dir
        else:
            _make_dataset_dir(data_dir)
            self._local_dir = None
        self._write_dir = data_dir
        features = tfds_features(self._steps, EPISODE_METADATA)
        self._serializer = ExampleSerializer(features.get_serialized_info())
        self._info = tfds.core.DatasetInfo(
            builder=tfds.core.DatasetIdentity(name=name, version=version, data_dir=data_dir,
                                              module_name=""),
            features=features, description=description or "RLDS episodes recorded by podracer.",
            metadata=tfds.core.MetadataDict(metadata or {}))
        self._info.set_file_format(FILE_FORMAT)
        self._template = tfds.core.ShardedFileTemplate(
            data_dir=data_dir, dataset_name=name, split=split, filetype_suffix=FILE_FORMAT,
            template="{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_INDEX}")
        self._split = split
        self._new_shard_writer = lambda path: ArrayRecordWriter(os.fspath(path), "group_size:1")
        self._max_shard_bytes = max_shard_bytes
        self._shard = None
        self._shard_lengths: list[int] = []
        self._shard_bytes: list[int] = []
        self._open_steps: dict[Hashable, list[dict]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.num_episodes = 0

    # -- whole episodes -------------------------------------------------------------

    def add_episode(self, steps: Mapping[str, Any]) -> int:
        """Write one episode given as RLDS-layout arrays `{field: [L, ...]}`; returns its id.

        `is_first`/`is_last` may be left out (they are set from the position);
        every other spec field is required. Values are cast to the spec's dtypes.
        """
        steps = self._checked(steps)
        with self._lock:
            return self._write(steps)

    def add_episodes(self, batch) -> list[int]:
        """Write every episode of an `EpisodeBatch` (e.g. from `make_recorder`); returns their ids."""
        return [self.add_episode(episode[STEPS]) for episode in unpad_episodes(batch)]

    # -- step by step ---------------------------------------------------------------

    def add_step(self, observation, action, reward, *, stream: Hashable = 0, **fields) -> None:
        """Append step t of `stream`'s open episode: o_t, the action a_t taken on it,
        the reward r_t that followed, and any other spec field (`discount` defaults
        to 1, others to zero)."""
        # Copies: actors often reuse their observation buffers for the next step.
        step = {name: np.array(value) for name, value in
                {OBSERVATION: observation, ACTION: action, REWARD: reward, **fields}.items()}
        unknown = set(step) - set(self._steps)
        if unknown:
            raise ValueError(f"fields {sorted(unknown)} are not in the dataset's step spec")
        flags = set(step) & {IS_FIRST, IS_LAST, IS_TERMINAL}
        if flags:
            raise ValueError(f"{sorted(flags)} are set by the writer; pass `terminated` to end_episode")
        with self._lock:
            self._open_steps.setdefault(stream, []).append(step)

    def end_episode(self, final_observation, terminated: bool, *, stream: Hashable = 0) -> int:
        """Close `stream`'s episode with its last observation and write it; returns its id.

        `terminated` marks a terminal state (`is_terminal`, and a zero discount on
        the step before); otherwise the episode was truncated.
        """
        with self._lock:
            open_steps = self._open_steps.pop(stream, [])
        if not open_steps:
            raise ValueError(f"stream {stream!r} has no open episode (call add_step first)")
        names = [name for name in self._steps if name not in (IS_FIRST, IS_LAST, IS_TERMINAL)]
        zero = lambda name: np.zeros(self._steps[name].shape, self._steps[name].dtype)
        rows = [{name: step.get(name, 1.0 if name == DISCOUNT else zero(name)) for name in names}
                for step in open_steps]
        if terminated:
            rows[-1][DISCOUNT] = 0.0
        rows.append({**{name: zero(name) for name in names}, OBSERVATION: final_observation})
        steps = {name: np.stack([np.asarray(row[name]) for row in rows]) for name in names}
        steps[IS_TERMINAL] = (np.arange(len(rows)) == len(rows) - 1) & bool(terminated)
        return self.add_episode(steps)

    # -- files ----------------------------------------------------------------------

    def _checked(self, steps: Mapping[str, Any]) -> dict[str, np.ndarray]:
        steps = {name: np.asarray(value) for name, value in steps.items()}
        length = len(steps[OBSERVATION])
        if length < 1:
            raise ValueError("an episode needs at least one step")
        position = np.arange(length)
        steps.setdefault(IS_FIRST, position == 0)
        steps.setdefault(IS_LAST, position == length - 1)
        checked = {}
        for name, spec in self._steps.items():
            if name not in steps:
                raise ValueError(f"episode lacks the step field {name!r}")
            value = steps[name]
            if value.shape != (length, *spec.shape):
                raise ValueError(f"step field {name!r} has shape {value.shape}, "
                                 f"expected {(length, *spec.shape)}")
            if not np.can_cast(value.dtype, spec.dtype, casting="same_kind"):
                raise ValueError(f"step field {name!r} holds {value.dtype}, expected {spec.dtype}")
            checked[name] = value.astype(spec.dtype)
        if not (np.array_equal(checked[IS_FIRST], position == 0)
                and np.array_equal(checked[IS_LAST], position == length - 1)):
            raise ValueError("is_first must be set on the first step only and is_last on the last only")
        return checked

    def _write(self, steps: dict[str, np.ndarray]) -> int:
        if self._closed:
            raise ValueError("the dataset writer is closed")
        episode_id = self.num_episodes
        length = len(steps[OBSERVATION])
        example = {
            STEPS: steps,
            "episode_id": np.int64(episode_id),
            "episode_return": np.float32(steps[REWARD][:-1].sum()),
            "episode_length": np.int64(length - 1),
        }
        # The arrays already have the spec's dtypes and shapes, which is all tfds's
        # per-step `encode_example` would do for plain tensors, in a Python loop.
        record = self._serializer.serialize_example(example)
        if self._shard is None:
            path = self._template.sharded_filepath(shard_index=len(self._shard_lengths),
                                                   num_shards=None)
            self._shard = self._new_shard_writer(path)
            self._shard_lengths.append(0)
            self._shard_bytes.append(0)
        self._shard.write(record)
        self._shard_lengths[-1] += 1
        self._shard_bytes[-1] += len(record)
        self.num_episodes += 1
        if self._shard_bytes[-1] >= self._max_shard_bytes:
            self._finish_shard()
        return episode_id

    def _finish_shard(self) -> None:
        if self._shard is not None:
            self._shard.close()
            self._shard = None
        tfds = import_tfds()
        split = tfds.core.SplitInfo(name=self._split, shard_lengths=list(self._shard_lengths),
                                    num_bytes=sum(self._shard_bytes), filename_template=self._template)
        self._info.set_splits(tfds.core.SplitDict([split]))
        self._info.write_to_directory(self._write_dir)

    def close(self) -> None:
        """Finish the last shard and write the dataset's metadata (and upload the dataset to a
        `gs://` `data_dir`); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._finish_shard()
            self._open_steps.clear()
            self._closed = True
            if self._local_dir is not None:
                self._upload()

    def _upload(self) -> None:
        local = self._local_dir
        try:
            storage.upload_tree(local, self.data_dir, last=("dataset_info.json",))
        except Exception as error:  # noqa: BLE001 - gcsfs raises OSError subclasses and HTTP errors
            reason = storage.failure(error)
            raise PodracerError(f"could not upload the dataset to {self.data_dir} ({reason}); it is kept "
                                f"in {local}: copy it with `gcloud storage rsync -r {local} "
                                f"{self.data_dir}`") from None
        shutil.rmtree(local, ignore_errors=True)

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
