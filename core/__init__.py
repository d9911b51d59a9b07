"""What the offline and online sides share, with no torch: config, checkpoint reading and writing, tokenizers,
the artifact manifest, targets, the cache format, placements and plans."""
