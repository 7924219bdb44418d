"""tf.train.Example records, read and written without importing TensorFlow (which takes seconds).

The message classes are built from tensorflow/core/example/{example,feature}.proto's schema, so the
bytes are exactly TensorFlow's (tests check both ways against TensorFlow itself).
"""

import functools

from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

_PACKAGE = "tensorflow"
_LABEL_REPEATED = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
_LABEL_OPTIONAL = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
_T = descriptor_pb2.FieldDescriptorProto


def _message(file_proto, name, fields, nested=(), options=None):
  msg = file_proto.message_type.add() if file_proto is not None else descriptor_pb2.DescriptorProto()
  msg.name = name
  for number, (field_name, field_type, label, type_name, packed, oneof) in enumerate(fields, start=1):
    field = msg.field.add(name=field_name, number=number, type=field_type, label=label)
    if type_name:
      field.type_name = type_name
    if packed:
      field.options.packed = True
    if oneof is not None:
      field.oneof_index = oneof
  for nested_msg in nested:
    msg.nested_type.add().CopyFrom(nested_msg)
  if options:
    msg.options.map_entry = True
  return msg


@functools.cache
def _classes():
  """(Example, Feature) message classes in a private descriptor pool."""
  f = descriptor_pb2.FileDescriptorProto(name="maxtext_tf_example.proto", package=_PACKAGE, syntax="proto3")
  _message(f, "BytesList", [("value", _T.TYPE_BYTES, _LABEL_REPEATED, None, False, None)])
  _message(f, "FloatList", [("value", _T.TYPE_FLOAT, _LABEL_REPEATED, None, True, None)])
  _message(f, "Int64List", [("value", _T.TYPE_INT64, _LABEL_REPEATED, None, True, None)])
  feature = _message(
    f,
    "Feature",
    [
      ("bytes_list", _T.TYPE_MESSAGE, _LABEL_OPTIONAL, ".tensorflow.BytesList", False, 0),
      ("float_list", _T.TYPE_MESSAGE, _LABEL_OPTIONAL, ".tensorflow.FloatList", False, 0),
      ("int64_list", _T.TYPE_MESSAGE, _LABEL_OPTIONAL, ".tensorflow.Int64List", False, 0),
    ],
  )
  feature.oneof_decl.add(name="kind")
  entry = _message(
    None,
    "FeatureEntry",
    [
      ("key", _T.TYPE_STRING, _LABEL_OPTIONAL, None, False, None),
      ("value", _T.TYPE_MESSAGE, _LABEL_OPTIONAL, ".tensorflow.Feature", False, None),
    ],
    options=True,
  )
  _message(
    f, "Features", [("feature", _T.TYPE_MESSAGE, _LABEL_REPEATED, ".tensorflow.Features.FeatureEntry", False, None)], [entry]
  )
  _message(f, "Example", [("features", _T.TYPE_MESSAGE, _LABEL_OPTIONAL, ".tensorflow.Features", False, None)])
  pool = descriptor_pool.DescriptorPool()
  pool.Add(f)
  get = lambda name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
  return get("Example"), get("Feature")


def parse(serialized: bytes) -> dict:
  """{feature name: list of bytes, floats or ints} of a serialized tf.train.Example ({} if it is none)."""
  example_cls, _ = _classes()
  try:
    example = example_cls.FromString(serialized)
  except message.DecodeError:
    return {}
  out = {}
  for name, feature in example.features.feature.items():
    kind = feature.WhichOneof("kind")
    out[name] = list(getattr(feature, kind).value) if kind else []
  return out


def serialize(features: dict) -> bytes:
  """A tf.train.Example of {name: bytes, str, list of ints or list of floats}."""
  example_cls, _ = _classes()
  example = example_cls()
  for name, value in features.items():
    feature = example.features.feature[name]
    if isinstance(value, str):
      value = value.encode("utf-8")
    if isinstance(value, bytes):
      feature.bytes_list.value.append(value)
    elif all(isinstance(v, int) for v in value):
      feature.int64_list.value.extend(int(v) for v in value)
    else:
      feature.float_list.value.extend(float(v) for v in value)
  return example.SerializeToString(deterministic=True)
