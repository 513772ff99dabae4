"""Part of pz_sparsecore.compat: upstream's module paths over pz_sparsecore."""
