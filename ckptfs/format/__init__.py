"""What lies in the store and in files: remote entries, checkpoint formats, profiles."""
