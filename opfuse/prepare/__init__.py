"""The model as the deployment fixes it, before any rewrite: bound inputs, static shapes,
the opset raised."""
