// Flex Consumption (FC1) function app running dbfanout's pollers and workers on Python, with
// identity-based connections only: no storage key, no Service Bus SAS, no App Insights key.
// The app-setting names below are what function_app.py and the dbfanout CLI read (DESIGN §3.3,
// docs/deploy.md); tests/infra/test_consistency.py checks each one is set here.

@description('Function app name.')
param name string

@description('Flex Consumption plan name.')
param planName string

@description('Azure region (must offer Flex Consumption).')
param location string

@description('Tags applied to the plan and the app.')
param tags object = {}

@description('azd service name, written as the azd-service-name tag.')
param serviceName string = 'api'

@description('Resource id of the user-assigned identity the app runs as.')
param identityId string

@description('Client id of that identity (the __clientId settings).')
param identityClientId string

@description('Blob endpoint of the storage account, with its trailing slash.')
param storageBlobEndpoint string

@description('Queue endpoint of the storage account, with its trailing slash.')
param storageQueueEndpoint string

@description('Blob container holding the deployment package.')
param deploymentContainerName string

@description('Service Bus namespace host name, for example sb-x.servicebus.windows.net.')
param serviceBusFullyQualifiedNamespace string

@description('Application Insights connection string (not a secret: ingestion needs an Entra token).')
param applicationInsightsConnectionString string

@description('Memory per instance in MB.')
@allowed([
  512
  2048
  4096
])
param instanceMemoryMB int = 2048

@description('Upper bound on instances; each instance runs its own worker functions.')
@minValue(1)
@maxValue(1000)
param maximumInstanceCount int = 40

@description('Python version of the Flex Consumption runtime.')
@allowed([
  '3.11'
  '3.12'
  '3.13'
])
param pythonVersion string = '3.11'

@description('Path of dbfanout.toml relative to the app root (DBFANOUT_CONFIG).')
param configPath string = 'dbfanout.toml'

@description('Storage-queue transport in use: also set DBFANOUT_STATE__queueServiceUri.')
param useStorageQueues bool = false

@description('Key Vault URI with trailing slash, for entries of databaseUrlSettings that give secretName; empty when no vault.')
param keyVaultUri string = ''

@description('Database URL app settings resolved from Key Vault: [{name, secretName} | {name, keyVaultSecretUri}].')
param databaseUrlSettings array = []

@secure()
@description('Database URL app settings given as values: {"ORDERS_DB_URL": "<url>"}.')
param databaseUrlValues object = {}

@description('Further app settings: {"NAME": "value"} (no secrets; use Key Vault references for those).')
param additionalAppSettings object = {}

var identitySettings = [
  {
    name: 'AzureWebJobsStorage__blobServiceUri'
    value: storageBlobEndpoint
  }
  {
    name: 'AzureWebJobsStorage__queueServiceUri'
    value: storageQueueEndpoint
  }
  {
    name: 'AzureWebJobsStorage__credential'
    value: 'managedidentity'
  }
  {
    name: 'AzureWebJobsStorage__clientId'
    value: identityClientId
  }
  {
    name: 'DBFANOUT_STATE__blobServiceUri'
    value: storageBlobEndpoint
  }
  {
    name: 'DBFANOUT_STATE__credential'
    value: 'managedidentity'
  }
  {
    name: 'DBFANOUT_STATE__clientId'
    value: identityClientId
  }
  {
    name: 'DBFANOUT_SERVICEBUS__fullyQualifiedNamespace'
    value: serviceBusFullyQualifiedNamespace
  }
  {
    name: 'DBFANOUT_SERVICEBUS__credential'
    value: 'managedidentity'
  }
  {
    name: 'DBFANOUT_SERVICEBUS__clientId'
    value: identityClientId
  }
  {
    name: 'DBFANOUT_CONFIG'
    value: configPath
  }
  {
    name: 'APPLICATIONINSIGHTS_CONNECTION_STRING'
    value: applicationInsightsConnectionString
  }
  {
    name: 'APPLICATIONINSIGHTS_AUTHENTICATION_STRING'
    value: 'ClientId=${identityClientId};Authorization=AAD'
  }
]

var storageQueueSettings = useStorageQueues ? [
  {
    name: 'DBFANOUT_STATE__queueServiceUri'
    value: storageQueueEndpoint
  }
] : []

// Key Vault references, resolved by the platform with keyVaultReferenceIdentity below.
var keyVaultDatabaseSettings = [for setting in databaseUrlSettings: {
  name: setting.name
  value: contains(setting, 'keyVaultSecretUri') ? '@Microsoft.KeyVault(SecretUri=${setting.keyVaultSecretUri})' : '@Microsoft.KeyVault(SecretUri=${keyVaultUri}secrets/${setting.secretName})'
}]

var valueDatabaseSettings = [for item in items(databaseUrlValues): {
  name: item.key
  value: item.value
}]

var extraSettings = [for item in items(additionalAppSettings): {
  name: item.key
  value: item.value
}]

resource plan 'Microsoft.Web/serverfarms@2024-04-01' = {
  // checkov:skip=CKV_AZURE_225: zone redundancy for Flex Consumption exists only in some regions; progress lives in the state blob and Service Bus, so a lost zone delays ticks, it loses nothing
  name: planName
  location: location
  tags: tags
  kind: 'functionapp'
  sku: {
    name: 'FC1'
    tier: 'FlexConsumption'
  }
  properties: {
    reserved: true
  }
}

resource site 'Microsoft.Web/sites@2024-04-01' = {
  // checkov:skip=CKV_AZURE_222: the app serves no HTTP trigger, but azd and func publish reach its deployment endpoint publicly; add VNet integration and private endpoints to close it
  // checkov:skip=CKV_AZURE_17: no HTTP trigger is served, so there is no client to present a certificate; timer and Service Bus triggers are outbound only
  // checkov:skip=CKV_AZURE_212: Flex Consumption scales on events; an idle app costs nothing and a poller resumes from the checkpoint in its state blob after a cold start, so no instance is kept warm by default (always-ready instances cost extra)
  // checkov:skip=CKV_AZURE_213: the health-check path pings an HTTP endpoint, which this app does not serve; use `dbfanout status` and the DLQ depth instead
  name: name
  location: location
  tags: union(tags, {
    'azd-service-name': serviceName
  })
  kind: 'functionapp,linux'
  identity: {
    type: 'UserAssigned'
    userAssignedIdentities: {
      '${identityId}': {}
    }
  }
  properties: {
    serverFarmId: plan.id
    httpsOnly: true
    keyVaultReferenceIdentity: identityId
    siteConfig: {
      minTlsVersion: '1.2'
      ftpsState: 'Disabled'
      http20Enabled: true
      appSettings: concat(identitySettings, storageQueueSettings, keyVaultDatabaseSettings, valueDatabaseSettings, extraSettings)
    }
    functionAppConfig: {
      deployment: {
        storage: {
          type: 'blobContainer'
          value: '${storageBlobEndpoint}${deploymentContainerName}'
          authentication: {
            type: 'UserAssignedIdentity'
            userAssignedIdentityResourceId: identityId
          }
        }
      }
      scaleAndConcurrency: {
        instanceMemoryMB: instanceMemoryMB
        maximumInstanceCount: maximumInstanceCount
      }
      runtime: {
        name: 'python'
        version: pythonVersion
      }
    }
  }
}

// Publishing uses Entra tokens (azd, func azure functionapp publish); basic auth stays off.
resource ftpCredentials 'Microsoft.Web/sites/basicPublishingCredentialsPolicies@2024-04-01' = {
  parent: site
  name: 'ftp'
  properties: {
    allow: false
  }
}

resource scmCredentials 'Microsoft.Web/sites/basicPublishingCredentialsPolicies@2024-04-01' = {
  parent: site
  name: 'scm'
  properties: {
    allow: false
  }
}

output name string = site.name
output id string = site.id
output defaultHostName string = site.properties.defaultHostName
