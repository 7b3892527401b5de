"""Read any RLDS-shaped tensorflow-datasets dataset from a local or `gs://` directory, without TensorFlow.

An RLDS-shaped dataset has a `steps` sequence feature per episode (RL
Unplugged, D4RL, envlogger and podracer datasets all do). array_record files are
read through tfds's data sources; tfrecord files with a small reader of their
framing, so neither needs TensorFlow. Records are decoded with tfds's own numpy
parser; steps made of plain tensors are decoded as whole arrays, anything else
(images, text) step by step through tfds.

    batch = load_episodes("/tmp/cartpole")            # EpisodeBatch, padded + mask
    windows = load_windows("/tmp/cartpole", size=8)   # {field: [M, 8, ...]}
    batch = jax.device_put(batch)                     # onto the default device

A directory may be `gs://BUCKET/PATH` (`pip install 'podracer-rl[gcs]'`): its
description is read there (tfds through `etils.epath`), and its records from a
temporary local copy (in `tempfile`'s directory: `TMPDIR`) removed once read,
since array_record and the tfrecord reader here read local files.
"""

from __future__ import annotations

import glob
import os
import posixpath
import struct
from typing import Any, Iterator, Mapping

import jax
import numpy as np

from podracer.data.episodes import EpisodeBatch, pad_episodes, windows
from podracer.data.spec import RLDS_MANDATORY, STEPS, import_tfds
from podracer.errors import PodracerError
from podracer import storage

# Per-step fields a caller needs, with the per-step shape each must have (None: any).
Requirements = Mapping[str, "tuple[int, ...] | None"]
DEFAULT_REQUIREMENTS: dict[str, tuple[int, ...] | None] = {name: () for name in RLDS_MANDATORY}


def find_dataset_dir(data_dir: str) -> str:
    """The directory under `data_dir` (local or `gs://`) that holds one tfds dataset's
    `dataset_info.json`."""
    data_dir = os.fspath(data_dir)
    remote = storage.is_remote(data_dir)
    if remote:
        if not storage.isdir(data_dir):
            raise PodracerError(f"dataset directory {data_dir} does not exist")
        if storage.exists(storage.join(data_dir, "dataset_info.json")):
            return data_dir
        path_of = posixpath
        paths = lambda pattern: storage.glob(data_dir, pattern)
    else:
        data_dir = os.path.expanduser(data_dir)
        if not os.path.isdir(data_dir):
            raise PodracerError(f"dataset directory {data_dir} does not exist")
        if os.path.isfile(os.path.join(data_dir, "dataset_info.json")):
            return data_dir
        path_of = os.path
        paths = lambda pattern: glob.glob(os.path.join(data_dir, pattern))
    # A tfds data_dir nests datasets as NAME/[CONFIG/]VERSION/.
    found = sorted({path_of.dirname(path) for depth in range(1, 4)
                    for path in paths("/".join(["*"] * depth + ["dataset_info.json"]))})
    if not found:
        raise PodracerError(f"no tensorflow-datasets dataset in {data_dir} (no dataset_info.json "
                            f"in it or below); pass the directory a dataset was written to")
    if len(found) > 1:
        shown = ", ".join(path_of.relpath(path, data_dir.rstrip("/")) for path in found[:3])
        more = ", ..." if len(found) > 3 else ""
        raise PodracerError(f"{data_dir} holds {len(found)} datasets ({shown}{more}); "
                            f"pass the directory of the one to read")
    return found[0]


def open_dataset(data_dir: str):
    """The tfds read-only builder of the dataset in (or below) `data_dir`; `.info` describes it."""
    tfds = import_tfds()
    path = find_dataset_dir(data_dir)
    try:
        return tfds.builder_from_directory(path)
    except Exception as error:  # tfds raises many types for a broken dataset directory
        raise PodracerError(f"cannot open the tensorflow-datasets dataset in {path}: "
                            f"{_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _feature_at(feature, path: str):
    """The sub-feature of a (nested) FeaturesDict at 'a/b', or None."""
    for part in path.split("/"):
        if not hasattr(feature, "keys") or part not in feature.keys():
            return None
        feature = feature[part]
    return feature


def check_fields(builder, requirements: Requirements = DEFAULT_REQUIREMENTS,
                 purpose: str = "reading it") -> None:
    """A one-line `PodracerError` if the dataset is not RLDS-shaped or a required
    step field is missing or has another per-step shape.

    `requirements` maps step fields ('observation', or 'observation/pixels' for a
    nested one) to the per-step shape they must have, or None for any shape.
    """
    tfds = import_tfds()
    where = f"dataset {builder.data_dir}"
    features = builder.info.features
    steps = features[STEPS] if STEPS in features.keys() else None
    if not isinstance(steps, tfds.features.Dataset):
        raise PodracerError(f"{where} is not RLDS-shaped: it has no '{STEPS}' sequence of steps "
                            f"(its features: {', '.join(features.keys())})")
    for field, shape in requirements.items():
        feature = _feature_at(steps.feature, field)
        if feature is None:
            raise PodracerError(f"{where} has no steps/{field} field (steps have: "
                                f"{', '.join(sorted(steps.feature.keys()))}); {purpose} needs it")
        if shape is None:
            continue
        got = feature.shape
        fits = isinstance(got, tuple) and len(got) == len(shape) and all(
            g is None or g == s for g, s in zip(got, shape))
        if not fits:
            raise PodracerError(f"{where}: steps/{field} has shape {got} per step but {purpose} "
                                f"needs {tuple(shape)}; use a dataset recorded on the same environment")


def _plain_tensor(feature) -> bool:
    """A fixed-shape tensor stored as numbers: its parsed value needs only a reshape."""
    tfds = import_tfds()
    return (type(feature) in (tfds.features.Tensor, tfds.features.Scalar)
            and None not in feature.shape
            and np.dtype(feature.get_serialized_info().np_dtype) == np.dtype(feature.np_dtype))


class _EpisodeDecoder:
    """Serialized episode -> `{"steps": {field: [L, ...]}, **metadata}` of numpy arrays."""

    def __init__(self, features, whole_arrays: bool = True):
        from tensorflow_datasets.core.example_parser import ExampleParserNp

        self._features = features
        self._parser = ExampleParserNp(features.get_serialized_info())
        step_leaves = jax.tree.leaves(_feature_tree(features[STEPS].feature))
        self._whole_arrays = whole_arrays and all(_plain_tensor(f) for f in step_leaves)

    def __call__(self, record: bytes) -> dict:
        parsed = self._parser.parse_example(record)
        episode = {key: self._features[key].decode_example_np(parsed[key])
                   for key in self._features.keys() if key != STEPS}
        if self._whole_arrays:
            as_steps = lambda feature, value: np.asarray(value, feature.np_dtype).reshape(
                (-1, *feature.shape))
            steps = jax.tree.map(as_steps, _feature_tree(self._features[STEPS].feature), parsed[STEPS])
        else:
            decoded = list(self._features[STEPS].decode_example_np(parsed[STEPS]))
            steps = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *decoded)
        return {STEPS: steps, **episode}


def _feature_tree(feature):
    """A (nested) FeaturesDict as nested plain dicts of its leaf features."""
    tfds = import_tfds()
    if isinstance(feature, tfds.features.FeaturesDict):
        return {key: _feature_tree(feature[key]) for key in feature.keys()}
    return feature


def _tfrecord_records(path: str) -> Iterator[bytes]:
    """Records of a TFRecord file: u64 length, u32 crc, data, u32 crc (checksums not verified)."""
    with open(path, "rb") as file:
        while header := file.read(12):
            if len(header) < 12:
                raise PodracerError(f"{path} ends inside a record header; the file is truncated")
            (length,) = struct.unpack("<Q", header[:8])
            data = file.read(length)
            if len(data) < length or len(file.read(4)) < 4:
                raise PodracerError(f"{path} ends inside a record; the file is truncated")
            yield data


def _records(builder, split: str) -> Iterator[bytes]:
    tfds = import_tfds()
    info = builder.info
    if split not in info.splits:
        raise PodracerError(f"dataset {builder.data_dir} has no split {split!r} "
                            f"(it has: {', '.join(info.splits.keys()) or 'none'})")
    file_format = info.file_format or tfds.core.FileFormat.TFRECORD
    if file_format not in (tfds.core.FileFormat.ARRAY_RECORD, tfds.core.FileFormat.TFRECORD):
        raise PodracerError(f"dataset {builder.data_dir} is stored as {file_format.value}; podracer "
                            f"reads array_record and tfrecord (convert it with `tfds convert_format`)")
    if info.splits[split].num_examples == 0:
        return
    data_dir = os.fspath(builder.data_dir)
    if storage.is_remote(data_dir):  # both formats are read from local files: read a copy
        with storage.downloaded(data_dir, prefix="podracer-dataset-") as local:
            try:
                yield from _records(tfds.builder_from_directory(local), split)
            except PodracerError as error:  # name the dataset, not its temporary copy
                raise PodracerError(str(error).replace(local, data_dir)) from None
        return
    if file_format == tfds.core.FileFormat.ARRAY_RECORD:
        source = builder.as_data_source(split=split,
                                        deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
        yield from (source[i] for i in range(len(source)))
    else:
        for path in info.splits[split].filepaths:
            yield from _tfrecord_records(os.fspath(path))


def iter_episodes(data_dir: str, split: str = "train", *, max_episodes: int | None = None,
                  requirements: Requirements = DEFAULT_REQUIREMENTS, purpose: str = "reading it",
                  ) -> Iterator[dict]:
    """Episodes `{"steps": {field: [L, ...]}, **metadata}` one at a time, in file order."""
    builder = open_dataset(data_dir)
    check_fields(builder, requirements, purpose)
    decode = _EpisodeDecoder(builder.info.features)
    for index, record in enumerate(_records(builder, split)):
        if max_episodes is not None and index >= max_episodes:
            return
        try:
            yield decode(record)
        except PodracerError:
            raise
        except Exception as error:  # a record that does not match features.json
            raise PodracerError(f"dataset {builder.data_dir}: episode {index} does not match the "
                                f"dataset's features ({_first_line(error)}); the files are corrupt or "
                                f"were written with another spec") from None


def read_episodes(data_dir: str, split: str = "train", **kwargs) -> list[dict]:
    """Every episode (or the first `max_episodes`) as a list of per-episode dicts."""
    return list(iter_episodes(data_dir, split, **kwargs))


def load_episodes(data_dir: str, split: str = "train", *, length: int | None = None,
                  **kwargs) -> EpisodeBatch:
    """Every episode as one padded `EpisodeBatch` ([N, L, ...] steps and an [N, L] mask)."""
    episodes = read_episodes(data_dir, split, **kwargs)
    if not episodes:
        raise PodracerError(f"dataset {data_dir} has no episodes in split {split!r}")
    return pad_episodes(episodes, length)


def load_windows(data_dir: str, size: int, *, stride: int = 1, split: str = "train",
                 **kwargs) -> dict[str, Any]:
    """Every window of `size` consecutive steps of one episode, as [M, size, ...] arrays."""
    return windows(load_episodes(data_dir, split, **kwargs), size, stride)


def dataset_metadata(data_dir: str) -> dict:
    """The dataset-level metadata (`metadata.json`; for podracer datasets: env, policy, seed)."""
    return dict(open_dataset(data_dir).info.metadata or {})


def describe_steps(data_dir: str) -> dict[str, Any]:
    """Per-step shape of every step field, as tfds reports it (nested for dict observations)."""
    builder = open_dataset(data_dir)
    check_fields(builder, {})
    return builder.info.features[STEPS].feature.shape

