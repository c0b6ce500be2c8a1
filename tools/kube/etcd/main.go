// Command etcd is etcd's own server program (go.etcd.io/etcd/server/v3's
// etcdmain), built here because no prebuilt etcd can be fetched.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
