"""One module per recurrence; the public names are re-exported from `deltanet_cp`."""
