"""mimo_data: everything from raw records to a rank's batches (sources, shards, index, CLIs)."""
