package channel

// SoftPD is softPD for the external tests.
var SoftPD = softPD
