"""Reads TFRecord files from a byte offset, checking every checksum, so a reader can resume mid-file.

tf.data's TFRecordDataset can only start at the beginning of a file; this reader seeks. The framing is
TensorFlow's (tensorflow/core/lib/io/record_writer.h): per record a little-endian uint64 length, the
masked CRC-32C of those 8 bytes, the data, and the masked CRC-32C of the data. Files open through
etils.epath (the path library TFDS uses), so local paths and gs:// both work.
"""

import struct

import google_crc32c
from etils import epath

from MaxText.errors import UserError

_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8


def _masked_crc(data: bytes) -> int:
  """TensorFlow's masked CRC-32C: a CRC stored next to the data it covers must not look like data."""
  crc = google_crc32c.value(data)
  return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


class TFRecordFile:
  """One TFRecord file, read record by record from any record boundary.

  Use as a context manager. A damaged or truncated file raises a UserError that names the file and the byte.
  """

  def __init__(self, path: str):
    self.path = str(path)
    try:
      self._file = epath.Path(path).open("rb")
    except OSError as e:
      raise UserError(f"cannot open {self.path}: {e.strerror or e}; the TFDS dataset's files must all be present") from None
    self._offset = 0

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._file.close()

  def tell(self) -> int:
    """The byte offset of the next record."""
    return self._offset

  def seek(self, offset: int) -> None:
    """Continue at byte `offset`, which must be a record boundary (an offset that tell() returned)."""
    self._file.seek(offset)
    self._offset = offset

  def _corrupt(self, what: str) -> UserError:
    return UserError(
      f"{self.path} is damaged ({what} at byte {self._offset}): copy the file again or prepare the dataset again"
    )

  def _length(self) -> int | None:
    """The next record's data length after checking its header, or None at the end of the file."""
    header = self._file.read(_HEADER.size)
    if not header:
      return None
    if len(header) < _HEADER.size:
      raise self._corrupt("truncated record header")
    length, length_crc = _HEADER.unpack(header)
    if _masked_crc(header[:8]) != length_crc:
      raise self._corrupt("record length checksum mismatch")
    return length

  def read(self) -> bytes | None:
    """The next record's bytes (checksum verified), or None at the end of the file."""
    length = self._length()
    if length is None:
      return None
    body = self._file.read(length + _FOOTER.size)
    if len(body) < length + _FOOTER.size:
      raise self._corrupt("truncated record")
    data = body[:length]
    if _masked_crc(data) != _FOOTER.unpack_from(body, length)[0]:
      raise self._corrupt("record checksum mismatch")
    self._offset += _HEADER.size + len(body)
    return data

  def skip(self, count: int) -> None:
    """Moves past `count` records reading only their headers (a sequential read: cheap on gs:// too)."""
    for skipped in range(count):
      length = self._length()
      if length is None:
        raise self._corrupt(f"end of file after {skipped} of the {count} records to skip")
      self._offset += _HEADER.size + length + _FOOTER.size
      self._file.seek(self._offset)
