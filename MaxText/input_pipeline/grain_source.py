"""dataset_type=grain: ArrayRecord files (local, or gs:// through a gcsfuse mount) as a random-access source."""

import glob

from MaxText.errors import UserError


def array_record_source(file_patterns: str, key: str):
  """The records of the files matching `;`-separated globs, in sorted file order (a grain ArrayRecordDataSource)."""
  patterns = [p.strip() for p in file_patterns.split(";") if p.strip()]
  if not patterns:
    raise UserError(f"{key} is empty; give ArrayRecord files, e.g. {key}=/data/c4-train.array_record-*")
  paths = []
  for pattern in patterns:
    if pattern.startswith("gs://"):
      raise UserError(f"{key}={pattern}: mount the bucket with gcsfuse (setup_gcsfuse.sh) and give the local path")
    matched = sorted(glob.glob(pattern))
    if not matched:
      raise UserError(f"{key}: '{pattern}' matches no file")
    paths += matched
  import grain  # pylint: disable=import-outside-toplevel  # here: synthetic data runs without grain

  try:
    return grain.sources.ArrayRecordDataSource(paths)
  except Exception as e:  # pylint: disable=broad-except  # array_record raises bare RuntimeErrors
    raise UserError(f"{key}: cannot read {paths[0]}... as ArrayRecord ({type(e).__name__}: {str(e)[:200]})") from None
