"""The disaggregated placement: trainer ranks and engine ranks are different processes (:mod:`.protocol`,
:mod:`.trainer_side`, :mod:`.engine_side`)."""
