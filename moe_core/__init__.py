"""What both services share: model config parsing, checkpoint access, the tensor wire codec,
the model fingerprint. One place for each fact; both services import it."""
