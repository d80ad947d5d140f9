"""Command-line client for the GPU service's GenerateService."""
