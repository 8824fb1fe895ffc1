"""Tensor parallelism over the mesh's ``tp`` axis: the conjugate collectives
(``collectives``), column/row parallel layers (``linear``), the vocabulary-parallel
embedding and cross-entropy (``vocab``), weight slices (``slices``), and AutoTP: plans
(``autotp_plans``), where they apply in a module tree (``autotp_tree``), their checks
(``autotp_check``) and their application (``autotp``).
"""
