"""Starting and supervising the processes of a run: locally (`supervisor`) or on a Ray cluster
(`ray_cluster`)."""
