// libkvbank.so: the installable C++ SDK (the client, the layouts, the prefix hashes and the
// generated wire code in one shared library; its users see only kvbank/*.h and Abseil).
#include "kvbank/version.h"

namespace kvbank {

const char* SdkVersion() { return KVBANK_VERSION_STRING; }

}  // namespace kvbank
