"""Model presets of real shapes built with random weights (``presets``) and the byte tokenizer they use
(``tokenizer``)."""
