"""Chat conversations -> token ids and the mask of the assistant turns, as Hugging Face's apply_chat_template renders them.

The template is Jinja2, rendered in the sandboxed environment that transformers uses (same options, filters and
globals), with the tokenizer's special tokens (bos_token, eos_token, ...) as variables; the text is then tokenized
with the tokenizer.json without adding special tokens, as apply_chat_template does. transformers is not needed.

The assistant turns are found by rendering prefixes of the conversation, which works for any template (no
{% generation %} markers needed): turn i spans from the end of render(messages[:i], add_generation_prompt=True) to
the end of render(messages[:i + 1]), less trailing whitespace (the separator before the next turn). That is the
turn's content and the end-of-turn token the template writes after it. A token counts when it starts in a span.
"""

import json
import os
from datetime import datetime

from MaxText.errors import UserError

# The tokenizer_config.json entries that transformers passes to a template as variables.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _environment():
  """transformers' chat template environment (utils/chat_template_utils.py), without its {% generation %} tracker."""
  try:
    import jinja2  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise UserError("chat templates need jinja2: pip install 'jinja2>=3.1.6' (in requirements.txt)") from None
  from jinja2.ext import loopcontrols  # pylint: disable=import-outside-toplevel
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel

  class _Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} renders its body (transformers uses it only to track spans)."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def load_template(tokenizer_path: str, chat_template: str) -> str:
  """The template text: chat_template (a file path or the template itself), else the tokenizer directory's own
  (chat_template.jinja, or tokenizer_config.json's "chat_template")."""
  if chat_template:
    if "{" not in chat_template and os.path.isfile(chat_template):
      with open(chat_template, encoding="utf-8") as f:
        return f.read()
    if "{" not in chat_template:
      raise UserError(f"chat_template={chat_template} is neither a file nor a Jinja2 template")
    return chat_template
  directory = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
  jinja_file = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return f.read()
  template = _read_json(os.path.join(directory, "tokenizer_config.json")).get("chat_template")
  if isinstance(template, list):  # several named templates: the default one
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  if not template:
    raise UserError(
      f"tokenizer_path={tokenizer_path} has no chat template (no chat_template.jinja, nor one in tokenizer_config.json): "
      "set chat_template to a Jinja2 template or a file holding one"
    )
  return template


def _special_tokens(tokenizer_path: str) -> dict:
  directory = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
  config = _read_json(os.path.join(directory, "special_tokens_map.json"))
  config.update(_read_json(os.path.join(directory, "tokenizer_config.json")))
  tokens = {}
  for key in _SPECIAL_TOKENS:
    token = config.get(key)
    token = token.get("content") if isinstance(token, dict) else token
    if token is not None:
      tokens[key] = token
  return tokens


class ChatRenderer:
  """Renders and tokenizes conversations with a Hugging Face tokenizer directory's chat template (or chat_template)."""

  def __init__(self, tokenizer_path: str, chat_template: str = ""):
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel

    file = os.path.join(tokenizer_path, "tokenizer.json") if os.path.isdir(tokenizer_path) else tokenizer_path
    if not file.endswith(".json") or not os.path.isfile(file):
      raise UserError(
        f"tokenizer_path={tokenizer_path}: chat templates need a Hugging Face tokenizer (a directory with tokenizer.json)"
      )
    self._tok = Tokenizer.from_file(file)
    self._variables = _special_tokens(tokenizer_path)
    source = load_template(tokenizer_path, chat_template)
    try:
      self._template = _environment().from_string(source)
    except Exception as e:  # pylint: disable=broad-except  # jinja2's TemplateSyntaxError and friends
      raise UserError(f"chat_template does not compile: {type(e).__name__}: {e}") from None

  def render(self, messages, add_generation_prompt: bool = False, where: str = "") -> str:
    """The conversation's text; a UserError naming `where` (e.g. the row) when the template fails."""
    try:
      return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self._variables)
    except Exception as e:  # pylint: disable=broad-except  # the template may raise anything (raise_exception, TypeError)
      raise UserError(f"the chat template fails to render {where or 'a conversation'}: {type(e).__name__}: {e}") from None

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_prompt(self, prompt: str) -> list[int]:
    """A prompt as a user turn followed by the generation prompt (decode.py use_chat_template=true)."""
    return self.encode(self.render([{"role": "user", "content": prompt}], add_generation_prompt=True, where="the prompt"))

  def end_of_turn_ids(self) -> list[int]:
    """The special tokens the template writes right after an assistant turn's content (ChatML's <|im_end|>, Llama
    3's <|eot_id|>, Gemma's <end_of_turn>, Llama 2's </s>): where a chat completion ends. [] when it writes none."""
    content = "x"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    text, [(start, end)] = self.assistant_spans(messages, "a one-turn conversation")
    tail = text[text.index(content, start) + len(content) : end]
    special = {i for i, token in self._tok.get_added_tokens_decoder().items() if token.special}
    return [i for i in self.encode(tail) if i in special]

  def assistant_spans(self, messages, where: str = "") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (see the module docstring)."""
    text = self.render(messages, where=where)
    spans = []
    for i, message in enumerate(messages):
      if message.get("role") != "assistant":
        continue
      start = len(self.render(messages[:i], add_generation_prompt=True, where=where))
      before = self.render(messages[: i + 1], where=where)
      if not text.startswith(before) or start > len(before):
        raise UserError(
          f"the chat template does not render {where or 'a conversation'} turn by turn (the text up to assistant turn "
          f"{i} is not a prefix of the whole), so its assistant tokens cannot be found: set chat_template"
        )
      spans.append((start, len(before.rstrip())))
    return text, spans

  def encode_with_mask(self, messages, where: str = "") -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation, and 1 for each token that starts inside an assistant turn."""
    text, spans = self.assistant_spans(messages, where)
    encoding = self._tok.encode(text, add_special_tokens=False)
    mask = [int(any(start <= begin < end for start, end in spans)) for begin, _ in encoding.offsets]
    return encoding.ids, mask
