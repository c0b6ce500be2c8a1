//! `lockstep-kube-double`: the in-memory Kubernetes API server of the tests,
//! served over HTTP on loopback for a `lockstep serve --orchestrator
//! kubernetes` in another process (or container) to talk to. Used by `cargo
//! xtask image` to start the environment's container with the shipped
//! Deployment's exact arguments.
//!
//! ```text
//! lockstep-kube-double --namespace NS --kubeconfig FILE [--deployment NAME [--image IMAGE] [--pod POD]]
//! ```
//!
//! Writes a kubeconfig for the server to FILE, creates the Deployment NAME in
//! NS if asked (the environment's owner object) and, with `--pod`, the
//! ReplicaSet it controls and the Pod POD that ReplicaSet controls (the
//! environment finds its Deployment from its own pod, as in a cluster),
//! prints `kube-double: serving on URL` and serves until killed.

use lockstep_kube_double::{kubeconfig, ApiServerDouble};

fn usage() -> ! {
    eprintln!("usage: lockstep-kube-double --namespace NS --kubeconfig FILE [--deployment NAME [--image IMAGE] [--pod POD]]");
    std::process::exit(2)
}

#[tokio::main]
async fn main() {
    let mut namespace = None;
    let mut kubeconfig_file = None;
    let mut deployment = None;
    let mut image = None;
    let mut pod = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--namespace" => namespace = Some(value),
            "--kubeconfig" => kubeconfig_file = Some(value),
            "--deployment" => deployment = Some(value),
            "--image" => image = Some(value),
            "--pod" => pod = Some(value),
            _ => usage(),
        }
    }
    let (Some(namespace), Some(kubeconfig_file)) = (namespace, kubeconfig_file) else {
        usage()
    };
    let api = ApiServerDouble::new();
    if let Some(name) = deployment {
        let created = api
            .create(
                "deployments",
                &namespace,
                serde_json::json!({"metadata": {"name": name}, "spec": match &image {
                    // The environment's container, whose image replica pods run.
                    Some(image) => serde_json::json!({"template": {"spec": {"containers": [
                        {"name": "environment", "image": image}
                    ]}}}),
                    None => serde_json::json!({}),
                }}),
            )
            .unwrap_or_else(|e| panic!("creating Deployment {name}: {e}"));
        if let Some(pod) = pod {
            let controlled_by = |kind: &str, api_version: &str, object: &serde_json::Value| {
                serde_json::json!([{
                    "apiVersion": api_version,
                    "kind": kind,
                    "name": object["metadata"]["name"],
                    "uid": object["metadata"]["uid"],
                    "controller": true,
                }])
            };
            let replica_set = api
                .create(
                    "replicasets",
                    &namespace,
                    serde_json::json!({"metadata": {
                        "name": format!("{name}-5d8f7c9b4"),
                        "ownerReferences": controlled_by("Deployment", "apps/v1", &created),
                    }, "spec": {}}),
                )
                .unwrap_or_else(|e| panic!("creating the ReplicaSet of {name}: {e}"));
            api.create(
                "pods",
                &namespace,
                serde_json::json!({"metadata": {
                    "name": pod,
                    "ownerReferences": controlled_by("ReplicaSet", "apps/v1", &replica_set),
                }, "spec": {"containers": []}}),
            )
            .unwrap_or_else(|e| panic!("creating Pod {pod}: {e}"));
        }
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let url = format!("http://{}", listener.local_addr().expect("bound"));
    std::fs::write(&kubeconfig_file, kubeconfig(&url, &namespace))
        .unwrap_or_else(|e| panic!("writing {kubeconfig_file}: {e}"));
    let server = api.serve(listener);
    println!("kube-double: serving on {url}");
    let _ = server.await;
}
