"""The model contract: repository layout and metadata, config.pbtxt, preprocessing and attention maps. Torch-free; shared by export/, bench/ and every process of the service."""
