"""Gemma 3 with images against transformers: a tiny random Gemma3ForConditionalGeneration (a 2-layer SigLIP on
56-pixel images, 16 patches pooled to 4 soft tokens; the 8-layer text model of convert_checkpoint_test with a sliding
window of 3, shorter than an image's run of soft tokens) converted with to_maxtext gives transformers' logits within
1e-4 (float32) with one image, two images in a row, and none; to_hf gives back the same bytes, and the exported model
loads with from_pretrained to the same logits; the encoder's params have logical axes of their own. Slow: the encoder
and train steps on fsdp 4 x tensor 2 give one device's soft tokens and losses (vision_layouts.py), with the frozen
encoder out of the optimizer; image-text SFT's step-0 loss is transformers'; decode.py with an image generates
transformers' tokens; 30 train.py steps on drawn shapes learn to read the images.
"""

import json
import os

import numpy as np
import pytest
import torch  # requirements-test.txt
import transformers

from MaxText.hf_conversion import converter, logit_check
from MaxText.input_pipeline import images
from MaxText.tests.helpers import run_python
from MaxText.tests.hf_parity import assert_round_trip_is_bitwise
from MaxText.tests.image_records import word_tokenizer, write_records
from MaxText.tests.tiny_models import HF_FAMILIES, HF_GEMMA3_VISION, HF_TINY, randomize_hf_weights

TOLERANCE = 1e-4  # float32; never loosened to make a test pass
IMAGE, BOI, EOI = 250, 251, 252  # the tiny vocabulary's image soft token, start and end of image
SOFT_TOKENS = 4
LENGTH = 24


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(hf_dir, maxtext_dir, transformers' model, the MaxText model and params) of the tiny model, built once."""
  root = tmp_path_factory.mktemp("gemma3_vision")
  text = {**HF_TINY, **HF_FAMILIES["gemma3"][1], "sliding_window": 3}
  config = transformers.Gemma3Config(
    text_config=text,
    vision_config=HF_GEMMA3_VISION,
    mm_tokens_per_image=SOFT_TOKENS,
    image_token_index=IMAGE,
    boi_token_index=BOI,
    eoi_token_index=EOI,
  )
  model = transformers.Gemma3ForConditionalGeneration(config)
  randomize_hf_weights(model, seed=5)
  model.save_pretrained(root / "hf")
  maxtext_dir = converter.to_maxtext(str(root / "hf"), str(root / "maxtext"))
  _, ours, params = logit_check.converted_model(maxtext_dir, os.path.join(root, "maxtext", converter.PARAMS_DIR), LENGTH)
  return str(root / "hf"), str(root / "maxtext"), _hf_model(str(root / "hf")), (ours, params)


def _row(num_images: int, length: int, seed: int) -> np.ndarray:
  """Text tokens with num_images runs of <start_of_image>, 4 soft tokens, <end_of_image>, spread over the row."""
  rng = np.random.default_rng(seed)
  row = rng.integers(0, 240, length)
  for k in range(num_images):
    start = 3 + k * (length // max(num_images, 1))
    row[start : start + SOFT_TOKENS + 2] = [BOI, *[IMAGE] * SOFT_TOKENS, EOI]
  return row


def _case(name: str):
  """(tokens (B, T), images (B, N, 3, 56, 56) or None) of a case."""
  rng = np.random.default_rng(len(name))
  images_per_row = {"one_image": 1, "two_images": 2, "no_image": 0}[name]
  tokens = np.stack([_row(images_per_row, LENGTH, seed) for seed in range(2)]).astype(np.int32)
  if not images_per_row:
    return tokens, None
  return tokens, rng.normal(size=(2, images_per_row, 3, 56, 56)).astype(np.float32)


def _hf_model(hf_dir: str):
  return transformers.Gemma3ForConditionalGeneration.from_pretrained(
    hf_dir, dtype=torch.float32, attn_implementation="eager"
  )


def _hf_logits(model, tokens, images) -> np.ndarray:
  ids = torch.from_numpy(tokens).long()
  pixels = None if images is None else torch.from_numpy(images.reshape(-1, *images.shape[2:]))
  with torch.no_grad():
    return model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits.numpy()


def _our_logits(model_and_params, tokens, images) -> np.ndarray:
  import jax  # pylint: disable=import-outside-toplevel

  model, params = model_and_params
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  with jax.default_matmul_precision("float32"):
    return np.asarray(model.apply({"params": params}, tokens, positions, images=images))


@pytest.mark.parametrize("case", ["one_image", "two_images", "no_image"])
def test_logits_match_transformers(converted, case):
  _, _, reference, ours = converted
  tokens, images = _case(case)
  max_abs, kl = logit_check.compare(_hf_logits(reference, tokens, images), _our_logits(ours, tokens, images))
  print(f"\n{case}: max |logits diff| {max_abs:.3g}, KL {kl:.3g}")
  assert max_abs < TOLERANCE, f"{case}: max |logits diff| {max_abs:.3g} (KL {kl:.3g})"


@pytest.mark.slow
def test_per_layer_run_loads_the_scanned_conversion(converted):
  """scan_layers=false (vision_encoder/layers_<i>, decoder/layers_<i>) loads the scanned params and gives the same
  logits."""
  hf_dir, maxtext_dir, reference, _ = converted
  del hf_dir
  tokens, images = _case("two_images")
  unrolled = logit_check.converted_model(
    os.path.join(maxtext_dir, converter.MODEL_YML), os.path.join(maxtext_dir, converter.PARAMS_DIR), LENGTH, False
  )[1:]
  assert "layers_1" in unrolled[1]["vision_encoder"]
  max_abs, _ = logit_check.compare(_hf_logits(reference, tokens, images), _our_logits(unrolled, tokens, images))
  assert max_abs < TOLERANCE


def test_round_trip_is_bitwise_and_reloads(converted, tmp_path):
  hf_dir, maxtext_dir, reference, _ = converted
  hf_out = assert_round_trip_is_bitwise(hf_dir, maxtext_dir, str(tmp_path))
  tokens, images = _case("two_images")
  np.testing.assert_array_equal(_hf_logits(_hf_model(hf_out), tokens, images), _hf_logits(reference, tokens, images))


def test_lora_adapts_the_text_model_only(converted):
  """A module path that would match the encoder's projections too (q_proj, fc1) adapts the text model alone: the
  encoder's dense layers multiply plainly."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.training import training_setup  # pylint: disable=import-outside-toplevel

  config = converter.maxtext_config(
    os.path.join(converted[1], converter.MODEL_YML), enable_lora=True, lora_module_path="(query|q_proj|fc1|wi_0)"
  )
  model, tokens = training_setup.create_model(config), np.zeros((1, LENGTH), np.int32)
  shapes = jax.eval_shape(lambda: model.init({"params": jax.random.PRNGKey(0)}, tokens, tokens))["params"]
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)]
  adapted = {p.split("'")[1] for p in paths if "lora_a" in p}
  assert adapted == {"decoder"}, adapted


def _mesh_axes(config) -> dict:
  """The mesh axes of the encoder's and the decoder's MLP and query kernels under config's logical_axis_rules."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.training import training_setup  # pylint: disable=import-outside-toplevel

  model, tokens = training_setup.create_model(config), np.zeros((1, 32), np.int32)
  specs = nn.get_partition_spec(jax.eval_shape(lambda: model.init({"params": jax.random.PRNGKey(0)}, tokens, tokens)))
  encoder, decoder = specs["params"]["vision_encoder"]["layers"], specs["params"]["decoder"]["layers"]
  kernels = {
    "fc1": encoder["fc1"]["kernel"],
    "fc2": encoder["fc2"]["kernel"],
    "q_proj": encoder["self_attn"]["q_proj"]["kernel"],
    "wi_0": decoder["mlp"]["wi_0"]["kernel"],
    "wo": decoder["mlp"]["wo"]["kernel"],
    "query": decoder["self_attention"]["query"]["kernel"][:3],  # [embed, layers, heads] (less head_dim)
  }
  return {name: tuple(nn.logical_to_mesh_axes(spec, config.logical_axis_rules)) for name, spec in kernels.items()}


def test_the_encoder_has_logical_axes_of_its_own():
  """The encoder's params name vit_embed, vit_heads and vit_mlp: base.yml's rules lay them out as the decoder's
  embed, heads and mlp, and rules of a run's own can lay out the encoder alone differently (here replicated)."""
  from MaxText.tests.helpers import tiny_config  # pylint: disable=import-outside-toplevel
  from MaxText.tests.vision_layouts import ARGS  # pylint: disable=import-outside-toplevel

  config = tiny_config(*ARGS)
  axes = _mesh_axes(config)
  assert (axes["fc1"], axes["fc2"], axes["q_proj"]) == (axes["wi_0"], axes["wo"], axes["query"])
  assert axes["fc1"][0] == ("fsdp", "sequence", "context", "expert")  # the rules are not empty
  replicated = [r for r in config.logical_axis_rules if not r[0].startswith("vit_")]
  replicated += [["vit_embed", []], ["vit_heads", []], ["vit_mlp", []]]
  own = _mesh_axes(tiny_config(*ARGS, logical_axis_rules=replicated))
  assert own["fc1"] == own["fc2"] == own["q_proj"] == (None, "stage", None)
  assert (own["wi_0"], own["wo"], own["query"]) == (axes["wi_0"], axes["wo"], axes["query"])


@pytest.mark.slow
def test_fsdp_and_tensor_parallel_give_one_device(tmp_path):
  """The encoder's soft tokens and 3 train steps' losses on fsdp 4 x tensor 2 equal one device's (relative 1e-5);
  the frozen encoder is in no optimizer state and does not move, the projector does; the encoder is sharded (about
  15 s with a warm compilation cache)."""
  report_path = tmp_path / "report.json"
  result = run_python(
    ["-m", "MaxText.tests.vision_layouts", str(report_path)],
    env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
  )
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(report_path.read_text())
  one, sharded = report["one_device"], report["fsdp4_tensor2"]
  soft, expected = np.asarray(sharded["soft_tokens"]), np.asarray(one["soft_tokens"])
  assert np.max(np.abs(soft - expected)) <= 1e-5 * np.max(np.abs(expected))  # relative to the outputs' scale
  np.testing.assert_allclose(sharded["losses"], one["losses"], rtol=1e-5)
  for run in (one, sharded):
    assert run["moved"]["vision_encoder"] == 0.0 and run["moved"]["vision_projector"] > 0
    assert not run["encoder_in_optimizer"]
  assert sharded["fc1_kernel_shard"] == [8, 2, 32]  # [embed / fsdp 4, layers, mlp / tensor 2]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["json", "parquet", "arrow"])
def test_image_sft_step0_loss_is_transformers_masked_cross_entropy(converted, tmp_path, capsys, kind):
  """Image-text SFT from JSON lines with relative image paths, or Parquet with an Image column (packing=false,
  completion only): the first batch's loss equals transformers' cross-entropy over the completions (relative 1e-4);
  a sample whose image tokens max_target_length would cut is dropped and counted."""
  import jax  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel

  from MaxText.features import selection  # pylint: disable=import-outside-toplevel
  from MaxText.input_pipeline import input_pipeline_interface  # pylint: disable=import-outside-toplevel
  from MaxText.runtime import mesh  # pylint: disable=import-outside-toplevel
  from MaxText.training import train_step  # pylint: disable=import-outside-toplevel

  _, maxtext_dir, reference, (model, params) = converted
  rng = np.random.default_rng(3)
  for i, size in enumerate([(40, 30), (70, 90), (56, 56)]):
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(tmp_path / f"img{i}.png")
  records = [
    {"prompt": "what is in <|image|> ?", "completion": "a red cat on a mat", "images": ["img0.png"]},
    {
      "prompt": "compare <|image|> and <|image|> please",
      "completion": "the first is brighter",
      "images": ["img1.png", "img2.png"],
    },
    {"prompt": " ".join(["word"] * 20) + " <|image|>", "completion": "cut", "images": ["img2.png"]},  # cut: dropped
    {"prompt": "say hello", "completion": "hello there", "images": []},
  ]
  words = " ".join(r["prompt"] + " " + r["completion"] for r in records).split()
  config = converter.maxtext_config(
    os.path.join(maxtext_dir, converter.MODEL_YML),
    dtype="float32",
    weight_dtype="float32",
    max_target_length=24,
    per_device_batch_size=3,
    dataset_type="hf",
    hf_path=kind,
    hf_train_files=write_records(records, tmp_path, kind),
    tokenizer_path=word_tokenizer(tmp_path / "tokenizer.json", words, (IMAGE, BOI, EOI)),
    use_sft=True,
    train_data_columns=["prompt", "completion"],
    sft_train_on_completion_only=True,
    packing=False,
    add_bos=False,
    add_eos=False,
    enable_data_shuffling=False,
    max_num_images_per_example=2,
  )
  iterator = input_pipeline_interface.create_data_iterator(config, mesh.create_device_mesh(config))
  batch = jax.tree.map(np.array, next(iterator))  # writable copies (torch reads them)
  iterator.close()
  assert batch["images"].shape == (3, 2, 3, 56, 56)
  assert "1 samples dropped whose image tokens max_target_length=24 would cut" in capsys.readouterr().out
  with jax.default_matmul_precision("float32"):
    loss, aux = train_step.loss_fn(model, config, selection.for_config(config), params, batch, jax.random.PRNGKey(0), True)
  total, count = 0.0, 0
  for row in range(3):  # transformers on each row's tokens alone, labels -100 outside the completion
    real = int(np.sum(batch["inputs_segmentation"][row] != 0))
    ids = batch["inputs"][row, :real][None]
    used = int(np.sum(ids == IMAGE)) // SOFT_TOKENS
    logits = _hf_logits(reference, ids, batch["images"][row : row + 1, :used] if used else None)[0].astype(np.float64)
    targets, weights = batch["targets"][row, :real], batch["targets_segmentation"][row, :real] != 0
    log_probs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    total -= np.sum(log_probs[np.arange(real), targets][weights])
    count += int(np.sum(weights))
  assert float(aux.weights) == count > 0
  print(f"\nimage SFT step-0 loss {float(loss / aux.weights):.7f}, transformers {total / count:.7f}, {count} tokens")
  assert float(loss / aux.weights) == pytest.approx(total / count, rel=1e-4)


@pytest.mark.slow
def test_decoding_with_an_image_gives_transformers_logits(converted):
  """Greedy decoding from a prompt with an image (the prefill's image attention both ways, through the KV cache):
  each sampled token's logits equal transformers' forward pass over the prompt and the tokens sampled."""
  from MaxText.inference import decoding  # pylint: disable=import-outside-toplevel
  from MaxText.runtime import mesh  # pylint: disable=import-outside-toplevel

  hf_dir, maxtext_dir, reference, _ = converted
  del hf_dir
  config, model, params = logit_check.converted_model(
    os.path.join(maxtext_dir, converter.MODEL_YML),
    os.path.join(maxtext_dir, converter.PARAMS_DIR),
    24,
    max_prefill_predict_length=16,
    per_device_batch_size=1,
    decode_sampling_strategy="greedy",
  )
  prompt = [5, 6, BOI, *[IMAGE] * SOFT_TOKENS, EOI, 7, 8]
  pixels = np.random.default_rng(7).normal(size=(1, 3, 56, 56)).astype(np.float32)
  result = decoding.generate(config, model, params, mesh.create_device_mesh(config), prompt, keep_logits=True, images=pixels)
  sequence = np.asarray([prompt + result.tokens[0].tolist()], np.int32)
  expected = _hf_logits(reference, sequence, pixels[None])[0, len(prompt) - 1 : -1]
  max_abs, _ = logit_check.compare(expected, result.logits[0])
  assert result.tokens.shape[1] == 8 and max_abs < TOLERANCE, max_abs


def _shapes_run(tmp_path, name: str, eval_file: str, files: dict, eval_interval: int) -> tuple[list[float], list[float]]:
  """train.py on the drawn shapes (30 steps, the tiny model of vision_layouts with images, from its random init),
  evaluating on eval_file every eval_interval steps; returns (train losses, held-out losses)."""
  from MaxText.tests.helpers import run_train  # pylint: disable=import-outside-toplevel
  from MaxText.tests.vision_layouts import ARGS  # pylint: disable=import-outside-toplevel

  result, metrics = run_train(
    tmp_path,
    name,
    *ARGS,
    "steps=30",
    "warmup_steps_fraction=0.1",  # the learning rate is 0 at step 0: the first eval is the initial params'
    "max_target_length=16",
    "per_device_batch_size=8",
    "max_num_images_per_example=1",
    "enable_checkpointing=false",
    "dataset_type=hf",
    "hf_path=json",
    f"hf_train_files={files['train']}",
    f"hf_eval_files={eval_file}",
    f"tokenizer_path={files['tokenizer']}",
    "use_sft=true",
    "train_data_columns=[prompt,completion]",
    "sft_train_on_completion_only=true",
    "packing=false",
    "add_bos=false",
    "add_eos=false",
    f"eval_interval={eval_interval}",
    "eval_steps=1",
    f"eval_per_device_batch_size={files['held_out']}",
  )
  assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
  train = [m["learning/loss"] for m in metrics if "learning/loss" in m]
  return train, [m["eval/loss"] for m in metrics if "eval/loss" in m]


@pytest.mark.slow
def test_training_on_drawn_shapes_learns_to_read_the_images(tmp_path):
  """The issue's learning test: 30 steps of image-text SFT on coloured shapes drawn with PIL, captioned "a red
  circle", lower the held-out loss (other drawings of the same 9 kinds), and after training the held-out loss with
  the right images is below the loss with the images shuffled (each caption given another colour and shape's
  image): the model reads its images. Two train.py runs, the same but for the eval file."""
  from MaxText.tests.image_records import shape_records  # pylint: disable=import-outside-toplevel

  train, held_out = shape_records(tmp_path, 8, seed=0, prefix="train"), shape_records(tmp_path, 2, seed=1, prefix="eval")
  # Shifted by 4 of the 9 kinds, every image lands on a caption of another colour and another shape.
  shuffled = [dict(r, images=held_out[(i + 4) % len(held_out)]["images"]) for i, r in enumerate(held_out)]
  words = " ".join(r["prompt"] + " " + r["completion"] for r in train).split()
  files = {
    "train": write_records(train, tmp_path, "json", "train"),
    "tokenizer": word_tokenizer(tmp_path / "tokenizer.json", words, (4000, 3001, 3002)),  # vision_layouts' ids
    "held_out": len(held_out),
  }
  # Every step's eval, the first after step 0 (learning rate 0): the initial params'.
  losses, right = _shapes_run(tmp_path, "right", write_records(held_out, tmp_path, "json", "eval_right"), files, 1)
  shuffled_file = write_records(shuffled, tmp_path, "json", "eval_shuffled")
  losses_again, [wrong] = _shapes_run(tmp_path, "shuffled", shuffled_file, files, 30)
  print(f"\nheld-out loss {right[0]:.4f} -> {right[-1]:.4f}; with shuffled images {wrong:.4f}")
  assert losses_again == losses and len(right) == 30  # the same training, only the eval differs
  assert right[-1] < 0.5 * right[0]
  assert right[-1] < 0.5 * wrong


@pytest.mark.slow
def test_decode_py_with_an_image_generates_transformers_tokens(converted, tmp_path):
  """decode.py's command line (a prompt with <|image|>, image_path, greedy) on the converted model generates the
  tokens of transformers' generate(do_sample=False) from Gemma3Processor's inputs (pixel_values, token_type_ids) for
  the same prompt and image. A tokenizer with a word per id ("t17") makes the text decode.py prints spell the ids."""
  import jax  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel

  from MaxText import decode  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import run_entry_point  # pylint: disable=import-outside-toplevel
  from MaxText.tests.image_records import id_tokenizer  # pylint: disable=import-outside-toplevel

  _, maxtext_dir, reference, _ = converted
  tokenizer = id_tokenizer(tmp_path / "tokenizer.json", reference.config.text_config.vocab_size, (IMAGE, BOI, EOI))
  image = Image.fromarray(np.random.default_rng(11).integers(0, 256, (70, 90, 3), dtype=np.uint8))  # resized to 56
  image.save(tmp_path / "image.png")
  argv = [
    "MaxText/decode.py",
    os.path.join(maxtext_dir, converter.MODEL_YML),
    "run_name=decode_image",
    f"base_output_directory={tmp_path}",
    f"load_parameters_path={os.path.join(maxtext_dir, converter.PARAMS_DIR)}",
    f"tokenizer_path={tokenizer}",
    "prompt=t5 t6 <|image|> t7 t8",
    f"image_path={tmp_path / 'image.png'}",
    "decode_sampling_strategy=greedy",
    "per_device_batch_size=1",
    "max_prefill_predict_length=16",
    "max_target_length=24",
    "dtype=float32",
    "weight_dtype=float32",
    "add_bos=false",
  ]
  with jax.default_matmul_precision("float32"):
    result = run_entry_point(decode.main, argv)
  assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
  [line] = [x for x in (result.stdout + result.stderr).splitlines() if "Input `" in x]
  ours = [int(word[1:]) for word in line.split("-> `", 1)[1].rstrip("`").split()]

  named = {"boi_token": images.BOI, "eoi_token": images.EOI, "image_token": images.IMAGE_TOKEN}
  processor = transformers.Gemma3Processor(
    image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
    tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer, extra_special_tokens=named),
    image_seq_length=SOFT_TOKENS,
  )
  inputs = processor(text=f"t5 t6 {images.BOI} t7 t8", images=[image], return_tensors="pt")
  reference.generation_config.eos_token_id = None  # decode.py's rows have no end token here (the tokenizer has none)
  with torch.no_grad():
    generated = reference.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0)
  expected = generated[0, inputs["input_ids"].shape[1] :].tolist()
  print(f"\ndecode.py: {ours}\ntransformers: {expected}")
  assert len(expected) == 8 and ours == expected
