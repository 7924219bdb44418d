"""Keys of base.yml's Multimodal section: Gemma 3's SigLIP vision encoder, its projector and the images' data."""

from MaxText.configuration.common_types import DTYPES, REMAT_POLICIES
from MaxText.configuration.config_keys import POSITIVE, Key, On, Range

_MM = On("use_multimodal", True)

SECTIONS = {
  "Multimodal": {
    "use_multimodal": Key("Images and text (Gemma 3): a vision encoder and projector put soft tokens in the text."),
    "freeze_vision_encoder_params": Key(
      "Keep the vision encoder out of the optimizer (the projector trains).", acts_with=_MM
    ),
    "dtype_mm": Key("The vision encoder's activation (compute) dtype.", choices=DTYPES, acts_with=_MM),
    "remat_policy_for_vit": Key("The vision encoder layers' remat policy (see remat_policy).", choices=REMAT_POLICIES),
    "image_size_for_vit": Key("The side of the (square) image that the encoder sees, in pixels.", range=POSITIVE),
    "patch_size_for_vit": Key("The side of a patch, in pixels; it divides image_size_for_vit.", range=POSITIVE),
    "num_channels_for_vit": Key("Colour channels of the image (RGB).", range=POSITIVE),
    "hidden_size_for_vit": Key("The vision encoder's width.", range=POSITIVE),
    "intermediate_size_for_vit": Key("The vision encoder's MLP width.", range=POSITIVE),
    "num_attention_heads_for_vit": Key("The vision encoder's attention heads; they divide its width.", range=POSITIVE),
    "num_hidden_layers_for_vit": Key("The vision encoder's layers.", range=POSITIVE),
    "mm_tokens_per_image": Key(
      "Soft tokens per image: the patches average-pooled to a square of this many (a square number).", range=POSITIVE
    ),
    "image_token_id": Key(
      "The id of the image soft token (<image_soft_token>) that an image's soft tokens replace.", range=Range(0)
    ),
    "image_placeholder": Key("The text that marks where an image goes in a prompt or a record's text."),
    "max_num_images_per_example": Key(
      "Images per row of the batch (rows with fewer are padded); -1: one.",
      range=Range(1, also=(-1,), says="-1 (one) or a positive integer"),
    ),
    "train_image_column": Key("The record field with the images (PIL images, bytes or paths) of the training data."),
    "eval_image_column": Key("The record field with the images of the eval data."),
    "image_path": Key("decode.py: an image file (or ','-separated files) for the prompt's image placeholders."),
  },
}
